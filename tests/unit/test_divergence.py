"""The distillation divergences on small distributions: zero at q = p, their identities, asymmetry, and that
each pulls a draft toward the target when minimised."""

import math

import pytest
import torch

from speculators_train.families.divergence import divergence

KINDS = ["forward_kl", "reverse_kl", "jsd", "tvd", "lk", "lk_hybrid"]


def dist(*values: float) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.float64)
    return t / t.sum()


@pytest.mark.parametrize("kind", KINDS)
def test_zero_when_the_draft_matches_and_positive_otherwise(kind):
    p, q = dist(5, 3, 1, 1), dist(1, 1, 3, 5)
    assert float(divergence(p, p.log(), kind)) == pytest.approx(0.0, abs=1e-12)
    assert float(divergence(p, q.log(), kind)) > 0.05


def test_identities():
    p, q = dist(5, 3, 1, 1), dist(2, 2, 3, 3)
    entropy = -(p * p.log()).sum()
    assert float(divergence(p, q.log(), "ce")) == pytest.approx(float(divergence(p, q.log(), "forward_kl") + entropy))
    # TVD = 1 - the probability that a draft sampled from q is accepted (sum of min(p, q)).
    assert float(divergence(p, q.log(), "tvd")) == pytest.approx(1 - float(torch.minimum(p, q).sum()))
    # JSD with beta 1/2 is symmetric and at most log 2.
    forward, backward = divergence(p, q.log(), "jsd"), divergence(q, p.log(), "jsd")
    assert float(forward) == pytest.approx(float(backward))
    assert float(divergence(dist(1, 0), dist(0.0 + 1e-30, 1).log(), "jsd")) <= math.log(2) + 1e-9


def test_lk_losses_are_built_on_the_acceptance_rate():
    p, q = dist(5, 3, 1, 1), dist(2, 2, 3, 3)
    alpha = float(torch.minimum(p, q).sum())
    assert float(divergence(p, q.log(), "lk")) == pytest.approx(-math.log(alpha))
    weight = math.exp(-3.0 * alpha)
    kl = float(divergence(p, q.log(), "forward_kl"))
    assert float(divergence(p, q.log(), "lk_hybrid")) == pytest.approx(weight * kl + (1 - weight) * (1 - alpha))
    # -log(alpha) has TV's gradient scaled by 1 / alpha: the scale is what lets it learn from a cold start.
    logits = q.log().clone().requires_grad_(True)
    divergence(p, torch.log_softmax(logits, -1), "lk").backward()
    lk_grad = logits.grad.clone()
    logits.grad = None
    divergence(p, torch.log_softmax(logits, -1), "tvd").backward()
    assert torch.allclose(lk_grad, logits.grad / alpha)
    # The hybrid's blend weight is not differentiated: its gradient is w * dKL + (1 - w) * dTV.
    logits.grad = None
    divergence(p, torch.log_softmax(logits, -1), "lk_hybrid").backward()
    hybrid_grad = logits.grad.clone()
    logits.grad = None
    divergence(p, torch.log_softmax(logits, -1), "forward_kl").backward()
    kl_grad = logits.grad.clone()
    logits.grad = None
    divergence(p, torch.log_softmax(logits, -1), "tvd").backward()
    assert torch.allclose(hybrid_grad, weight * kl_grad + (1 - weight) * logits.grad)


def test_reverse_kl_seeks_a_mode_and_forward_kl_covers_both():
    p = dist(10, 0.01, 10)  # two modes
    on_one_mode, spread = dist(10, 0.01, 0.01), dist(1, 1, 1)
    assert divergence(p, on_one_mode.log(), "reverse_kl") < divergence(p, spread.log(), "reverse_kl")
    assert divergence(p, on_one_mode.log(), "forward_kl") > divergence(p, spread.log(), "forward_kl")


@pytest.mark.parametrize("kind", KINDS)
def test_minimising_pulls_the_draft_to_the_target(kind):
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(4, 8) * 2, dim=-1)
    logits = torch.zeros(4, 8, requires_grad=True)
    opt = torch.optim.Adam([logits], lr=0.1)
    for _ in range(300):
        opt.zero_grad()
        divergence(p, torch.log_softmax(logits, dim=-1), kind).sum().backward()
        opt.step()
    q = torch.softmax(logits.detach(), dim=-1)
    assert (q - p).abs().sum(-1).max() < 0.1
    with pytest.raises(ValueError, match="unknown divergence 'kl'"):
        divergence(p, q.log(), "kl")


# speculators' name for each of ours (`speculators.losses.eager`, the reference the LK paper's authors point to);
# theirs take logits for both sides, ours the target's probabilities and the draft's log-probabilities.
SPECULATORS_LOSSES = {
    "forward_kl": "kl_div_loss",
    "reverse_kl": "reverse_kl_div_loss",
    "jsd": "js_div_loss",
    "tvd": "tv_loss",
    "lk": "neg_log_acceptance_loss",
    "lk_hybrid": "lk_hybrid_loss",
}


@pytest.mark.parametrize("kind", list(SPECULATORS_LOSSES))
def test_each_divergence_is_the_speculators_librarys_own(kind):
    eager = pytest.importorskip("speculators.losses.eager")
    gen = torch.Generator().manual_seed(0)
    draft, target = torch.randn(1, 7, 50, generator=gen) * 3, torch.randn(1, 7, 50, generator=gen) * 3
    theirs = getattr(eager, SPECULATORS_LOSSES[kind])(draft, target)
    ours = divergence(torch.softmax(target, -1), torch.log_softmax(draft, -1), kind)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6)
