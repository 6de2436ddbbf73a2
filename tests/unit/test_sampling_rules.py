"""The acceptance rules on small synthetic distributions: exactness by sampling, with negative controls showing the
statistic would catch the classic bugs (bonus token from the draft, resampling from p instead of the residual)."""

import pytest
import torch

from speculators_train.proposal import Sampling
from speculators_train.verify import sampling as rules

N = 20_000


def tv(samples: list[int], p: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples, device=p.device), minlength=p.numel()).double() / len(samples)
    return 0.5 * float((counts - p.double()).abs().sum())


def tv_threshold(p: torch.Tensor, n: int = N) -> float:
    """4x the expected sampling noise of TV for n draws (sum of per-token standard deviations / 2)."""
    return 4 * 0.5 * float((p.double() * (1 - p.double()) / n).sqrt().sum())


P = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4], [0.05, 0.05, 0.1, 0.8]])  # positions 1..3
Q = torch.tensor([[0.1, 0.6, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])


def chain_tokens(p: torch.Tensor, q: torch.Tensor, k: int, seed: int, rule=rules.accept_chain_sampled) -> list[int]:
    """Emitted tokens of one verify step (drafts sampled from q), padded to k+1 with -1."""
    g = torch.Generator().manual_seed(seed)
    drafts = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(k)]
    a, token = rule(drafts, q[:k], p[: k + 1], g)
    return (drafts[:a] + [token] + [-1] * k)[: k + 1]


def test_first_token_of_a_chain_is_distributed_as_the_target():
    first = [chain_tokens(P, Q, 2, seed)[0] for seed in range(N)]
    assert tv(first, P[0]) < tv_threshold(P[0])


def test_bonus_token_comes_from_the_target_not_the_draft():
    # The draft agrees with the target at positions 1-2, so both drafts are always accepted and token 3 is the bonus.
    q = torch.stack([P[0], P[1], Q[2]])
    third = [chain_tokens(P, q, 2, seed)[2] for seed in range(N)]
    assert tv(third, P[2]) < tv_threshold(P[2])

    def bonus_from_draft(drafts, q_, p_, g):
        a, token = rules.accept_chain_sampled(drafts, q_, p_, g)
        if a == len(drafts):
            token = int(torch.multinomial(q[2], 1, generator=g))
        return a, token

    broken = [chain_tokens(P, q, 2, seed, bonus_from_draft)[2] for seed in range(N)]
    assert tv(broken, P[2]) > 5 * tv_threshold(P[2]), "the statistic cannot see a bonus drawn from the draft"


def test_second_token_given_the_first_is_distributed_as_the_target():
    # p rows do not depend on the prefix here, so the second token's law is P[1] whatever the first was; it is
    # emitted by this step only when the first draft was accepted.
    samples = [chain_tokens(P, Q, 2, seed) for seed in range(2 * N)]
    second = [s[1] for s in samples if s[1] >= 0]
    assert len(second) > N // 4
    assert tv(second, P[1]) < tv_threshold(P[1], len(second))


def test_argmax_drafts_verified_as_point_masses_give_the_targets_first_and_second_tokens():
    """Engines draft the argmax at T > 0 and verify it with q = a point mass (q None here): still exact."""
    drafts = Q.argmax(-1).tolist()[:2]
    samples = []
    for seed in range(2 * N):
        a, token = rules.accept_chain_sampled(drafts, None, P, torch.Generator().manual_seed(seed))
        samples.append([*drafts[:a], token, -1, -1][:3])
    assert tv([s[0] for s in samples], P[0]) < tv_threshold(P[0])
    second = [s[1] for s in samples if s[1] >= 0]
    assert len(second) > N // 4
    assert tv(second, P[1]) < tv_threshold(P[1], len(second))
    assert torch.equal(rules.point_masses(drafts, 4, torch.device("cpu")), torch.eye(4)[drafts])


def test_rejection_must_resample_from_the_residual_not_from_p():
    def resample_from_p(drafts, q_, p_, g):
        for i, token in enumerate(drafts):
            if float(torch.rand((), generator=g)) * q_[i, token] >= p_[i, token]:
                return i, int(torch.multinomial(p_[i], 1, generator=g))
        return len(drafts), int(torch.multinomial(p_[len(drafts)], 1, generator=g))

    broken = [chain_tokens(P, Q, 2, seed, resample_from_p)[0] for seed in range(N)]
    assert tv(broken, P[0]) > 5 * tv_threshold(P[0])


def test_tree_children_rule_is_distributed_as_the_target():
    tokens = [1, 0, 3]  # three deterministic candidates at one node, best first
    out = []
    for seed in range(N):
        g = torch.Generator().manual_seed(seed)
        child, token = rules.accept_children_sampled([0, 1, 2], tokens, P[0], g)
        assert child is None or tokens[child] == token
        out.append(token)
    assert tv(out, P[0]) < tv_threshold(P[0])


def test_greedy_chain_takes_the_matching_prefix_then_the_targets_choice():
    logits = torch.tensor([[0.0, 5.0, 0.0], [4.0, 0.0, 0.0], [0.0, 0.0, 3.0], [0.0, 9.0, 0.0]])
    assert rules.accept_chain_greedy([1, 0, 1], logits) == (2, 2)  # third draft wrong: correction is 2
    assert rules.accept_chain_greedy([1, 0, 2], logits) == (3, 1)  # all accepted: bonus is the last argmax
    assert rules.accept_chain_greedy([0, 0, 2], logits) == (0, 1)


@pytest.mark.parametrize("top_p", [0.5, 0.8, 1.0])
def test_top_p_keeps_the_smallest_head_reaching_p(top_p):
    logits = torch.log(torch.tensor([0.45, 0.3, 0.15, 0.1]))
    probs = rules.target_probs(logits, Sampling(1.0, top_p))
    kept = {0.5: 2, 0.8: 3, 1.0: 4}[top_p]
    assert (probs > 0).sum() == kept
    assert probs.sum() == pytest.approx(1.0)
