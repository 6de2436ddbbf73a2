"""vLLM's own model classes, imported here (seconds of vLLM's import, no server), on our exports: its MLPSpeculator
loads every tensor of the MLP family's export and computes our stages."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from speculators_train.export.run import export
from speculators_train.families import get
from speculators_train.verify.run import load_draft_for
from tests.conftest import start_of


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
