"""The MLP speculator family: vLLM's own config and model classes load our export and compute our stages, the
loop accepts what training teaches, and later stages see the earlier drafts."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from speculators_train.errors import UserError
from speculators_train.export.run import export
from speculators_train.families import get
from speculators_train.proposal import Sampling
from speculators_train.verify.decoder import SpeculativeDecoder
from speculators_train.verify.run import eos_ids, load_draft_for
from tests.conftest import SHAREGPT, make_recipe, start_of


class Embedding(nn.Embedding):  # vLLM's VocabParallelEmbedding on one rank, without its process group
    def __init__(self, num, dim, **_):
        super().__init__(num, dim)


class Head(nn.Linear):  # vLLM's ParallelLMHead on one rank: a [vocab, dim] weight
    def __init__(self, vocab, dim, bias=False, **_):
        super().__init__(dim, vocab, bias=bias)


def vllm_speculator(out, monkeypatch):
    """vLLM's MLPSpeculator, built by its own __init__ from its own config class reading our config.json, holding
    what its own load_weights takes from our safetensors (the tensor-parallel layers swapped for one-rank ones)."""
    from safetensors.torch import load_file
    from vllm.model_executor.models import mlp_speculator
    from vllm.transformers_utils.configs.mlp_speculator import MLPSpeculatorConfig

    monkeypatch.setattr(mlp_speculator, "VocabParallelEmbedding", Embedding)
    monkeypatch.setattr(mlp_speculator, "ParallelLMHead", Head)
    monkeypatch.setattr(mlp_speculator, "LogitsProcessor", lambda *a, **k: None)
    config = MLPSpeculatorConfig(**json.loads((out / "config.json").read_text()))
    model = mlp_speculator.MLPSpeculator(vllm_config=SimpleNamespace(model_config=SimpleNamespace(hf_config=config)))
    loaded = model.load_weights(load_file(out / "model.safetensors").items())
    return model, loaded


@pytest.mark.parametrize("tie", [True, False])
def test_vllms_own_classes_load_our_export_and_compute_our_stages(tmp_path, target, fitted, monkeypatch, tie):
    """Every parameter of vLLM's MLPSpeculator is loaded from our file (a tied one once, by its first index), and
    its modules and constants (state and embedding weights, its layer norm, GELU), composed as its proposal loop
    composes them, give our stage logits on the same state and tokens. The untied draft is at random weights: the
    check is of the files and the arithmetic, which no fit changes."""
    from speculators_train.training.checkpoint import save_checkpoint

    recipe, checkpoint, prompt, reply = fitted("mlp")
    if not tie:
        family = get("mlp")
        settings = family.settings(n_predict=3, inner_dim=128, tie_weights=False)
        head = {"lm_head": target.lm_head.weight}
        draft = family.new_draft(settings, start_of(target.config, head, torch.zeros(1), []))
        checkpoint = save_checkpoint(tmp_path / "untied", 1, draft, None, {"step": 1}, keep_last=1)
    out = export(recipe, checkpoint, "vllm", tmp_path / "vllm", "float32").path
    vl, loaded = vllm_speculator(out, monkeypatch)
    assert loaded == {name for name, _ in vl.named_parameters()}
    draft = load_draft_for(target, checkpoint).draft
    ids = torch.tensor([prompt + reply])
    with torch.no_grad():
        _, final = target.hidden_states(ids, torch.ones_like(ids))
        z = target.final_norm(final[0, len(prompt) - 1 :: 7])  # a few positions as a batch
        tokens = [ids[0, len(prompt) + i :: 7][: len(z)] for i in range(3)]
        ours, theirs = draft.start(z), vl.ln0(z) / math.sqrt(2)
        for i in range(3):
            ours, mine = draft.stage(i, ours, tokens[i])
            states = vl.proj[i](theirs)
            states.add_(vl.emb[i](tokens[i]), alpha=vl.emb_weight / vl.state_weight)
            theirs = vl.activation(vl.ln[i](states))
            torch.testing.assert_close(vl.head[i](theirs), mine, rtol=1e-4, atol=1e-4)


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
