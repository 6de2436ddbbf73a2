"""The MTP slot of architectures whose layers differ by index: the head's layer is the target's class at index n,
of the kind the config's per-layer lists give the target's last layer, with full attention."""

import pytest
import torch
from transformers import AutoConfig

from speculators_train.families.mtp.checkpoint import one_layer_config
from speculators_train.families.mtp.model import MTPConfig, MTPDraft, mtp_layer_config

SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1}
SMALL.update(head_dim=16, num_hidden_layers=4, vocab_size=64)


def text_config(model_type: str, **values):
    return AutoConfig.for_model(model_type, **SMALL, **values)


@pytest.mark.parametrize(
    ("model_type", "values"),
    [
        ("llama4_text", {"num_local_experts": 2, "intermediate_size_mlp": 64, "attention_chunk_size": 8}),
        ("gemma3_text", {"sliding_window": 8}),
        ("gpt_oss", {"num_local_experts": 2, "num_experts_per_tok": 1, "sliding_window": 8}),
    ],
)
def test_the_slot_extends_every_per_layer_list_and_the_head_runs(model_type, values):
    text = text_config(model_type, **values)
    slot = mtp_layer_config(text)
    lists = [k for k, v in vars(text).items() if isinstance(v, list) and len(v) == text.num_hidden_layers]
    assert lists, "each of these architectures keeps per-layer lists"
    for name in lists:
        expected = "full_attention" if name == "layer_types" else getattr(text, name)[-1]
        assert getattr(slot, name) == [*getattr(text, name), expected], name
    one = one_layer_config(text)
    assert all(getattr(one, name) == getattr(slot, name)[-1:] for name in lists)
    torch.manual_seed(0)
    config = MTPConfig(layer_config=text.to_dict(), num_steps=2, target_num_layers=text.num_hidden_layers)
    draft = MTPDraft(config)
    if model_type == "llama4_text":  # Llama-4's last layer of 4 is a NoPE one: so is the slot's
        assert draft.block.self_attn.use_rope == bool(text.no_rope_layers[-1])
    hidden, tokens = torch.randn(1, 5, 32), torch.randint(0, 64, (1, 5))
    out = draft.step(hidden, tokens, torch.arange(5)[None])
    assert out.shape == (1, 5, 32) and torch.isfinite(out).all()
