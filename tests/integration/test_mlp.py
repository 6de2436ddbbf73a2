"""The MLP speculator family: the loop accepts what training teaches, and later stages see the earlier drafts
(vLLM's own classes read its export in tests/e2e/test_vllm_classes.py)."""

import pytest
import torch

from speculators_train.errors import UserError
from speculators_train.families import get
from speculators_train.proposal import Sampling
from speculators_train.verify.decoder import SpeculativeDecoder
from speculators_train.verify.run import eos_ids, load_draft_for
from tests.conftest import SHAREGPT, make_recipe, start_of


def test_the_loop_accepts_what_training_teaches_and_later_stages_see_earlier_drafts(target, fitted):
    """A speculator fitted to the target's reply has its drafts accepted in the loop (an off-by-one pairing of
    states and tokens would accept almost none) with the target's own greedy output; stage 1's guess changes with
    the token stage 0 drafted, which Medusa's independent heads cannot do."""
    _, checkpoint, prompt, reply = fitted("mlp")
    draft = load_draft_for(target, checkpoint).draft
    proposer = get("mlp").proposer(draft, target)
    result = SpeculativeDecoder(target, proposer, Sampling(), 3).generate(prompt, 48, eos_ids(target))
    assert result.tokens == reply[: len(result.tokens)]
    assert sum(result.accepted) >= 1.5 * len(result.accepted), result.accepted
    z = torch.zeros(draft.config.emb_dim)
    with torch.no_grad():
        s0, _ = draft.stage(0, draft.start(z), torch.tensor(reply[0]))
        _, after_a = draft.stage(1, s0, torch.tensor(reply[1]))
        _, after_b = draft.stage(1, s0, torch.tensor(reply[2]))
    assert not torch.allclose(after_a, after_b)


def test_the_proposer_reads_the_pairs_training_scores(target, prompts, references):
    """Stage 0 in the loop, after committing x_1..x_{t+1} with the states y_0..y_t, gives the distribution the
    objective scores at position t (y_t and x_{t+1}, predicting x_{t+2}): the proposer's per-position divergences
    sum to the objective's loss_0. The draft is at random weights, so the token it is fed matters (a fitted one can
    read the next token off the state alone, which hides a wrong pairing)."""

    family = get("mlp")
    settings = family.settings(n_predict=2, inner_dim=64)
    torch.manual_seed(0)
    draft = family.new_draft(settings, start_of(target.config, {"lm_head": target.lm_head.weight}, torch.zeros(1), []))
    ids = torch.tensor([prompts[0] + references[0][:16]])
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[0, len(prompts[0]) :] = True
    head = target.head()
    with torch.no_grad():
        _, final = target.hidden_states(ids, torch.ones_like(ids))
        _, sums = family.objective(draft, head, settings).eval()(
            {"input_ids": ids, "hidden_state": final, "loss_mask": mask}
        )
        proposer, expected, scored = family.proposer(draft, target), 0.0, 0
        for t in range(ids.shape[1] - 2):
            if mask[0, t + 2]:
                proposer.extend(ids[0, 1 : t + 2].tolist(), final[0, : t + 1])
                _, q = proposer.propose_chain(1, Sampling(1.0, draft_sampling="sample"), torch.Generator())
                p = torch.softmax(head(final[0, t + 1]).float(), dim=-1)
                expected += float((p * (p.clamp_min(1e-30).log() - q[0].log())).sum())
                scored += 1
    total, count = sums["loss_0"].tolist()
    assert count == scored == 16
    assert total == pytest.approx(expected, rel=1e-4)


def test_a_tied_single_stage_and_trees_are_refused_at_recipe_load(tmp_path):
    from speculators_train.recipe import load_recipe

    sources = [{"name": "sharegpt", "path": SHAREGPT, "max_records": 4}]
    with pytest.raises(UserError, match=r"tie_weights needs n_predict >= 2"):
        load_recipe(make_recipe(tmp_path, sources, draft={"family": "mlp", "n_predict": 1}))
    with pytest.raises(UserError, match=r"eval.mode 'tree': an MLP speculator drafts chains"):
        load_recipe(make_recipe(tmp_path, sources, draft={"family": "mlp"}, eval={"mode": "tree"}))
