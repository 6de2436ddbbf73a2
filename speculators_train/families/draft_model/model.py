"""A standalone draft: a causal LM of the target's family and tokenizer, with its own KV cache at inference.

    logits_t = lm(x_0 .. x_t)      predicts x_{t+1}; trained toward the target's distribution for x_{t+1}

Its output layer covers the target's whole vocabulary (engines verify draft ids as target ids), and is never tied
to its embedding here, so each can be trained and every engine reads the same two matrices.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig

from speculators_train.families.eagle_arch.model import check_layer
from speculators_train.families.format_common import (
    FILE_KEYS,
    MAX_HIDDEN,
    MAX_LAYERS,
    MAX_VOCAB,
    dict_field,
    int_field,
)

MAX_DRAFT_LAYERS = 256  # a draft deeper than this is no draft


@dataclass
class DraftModelConfig:
    model_config: dict[str, Any]  # the draft LM's LlamaConfig, as a dict (model_type "llama")
    target_hidden_size: int = 0  # 0: it reads no target state, so any target width fits
    target_vocab_size: int = 0
    target_num_layers: int = 0  # 0: not recorded

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def llama(self) -> LlamaConfig:
        return LlamaConfig(**self.model_config)


def lm_values(values: dict[str, Any]) -> dict[str, Any]:
    """A config dict without the keys that describe a saved file (`FILE_KEYS`)."""
    return {k: v for k, v in values.items() if k not in FILE_KEYS}


def model_config(config: Any) -> dict[str, Any]:
    """A LlamaConfig dict for a draft LM shaped as `config` (a transformers config), untied."""
    return {**lm_values(config.to_dict()), "model_type": "llama", "tie_word_embeddings": False}


def checked_config(values: dict[str, Any]) -> DraftModelConfig:
    """A DraftModelConfig from a saved file, each value typed and in range before anything is built."""
    layer = dict_field(values, "model_config")
    check_layer(layer, "model_config.")  # LlamaConfig's values, typed and in range
    int_field(layer, "num_hidden_layers", 1, MAX_DRAFT_LAYERS, name="model_config.num_hidden_layers")
    if layer.get("tie_word_embeddings"):
        raise ValueError("model_config.tie_word_embeddings must be false: the draft's head is its own")
    vocab = int_field(values, "target_vocab_size", 1, MAX_VOCAB)
    if layer["vocab_size"] != vocab:
        raise ValueError(f"model_config.vocab_size {layer['vocab_size']} must be the target's {vocab}")
    return DraftModelConfig(
        model_config=layer,
        target_hidden_size=int_field(values, "target_hidden_size", 0, MAX_HIDDEN, default=0),
        target_vocab_size=vocab,
        target_num_layers=int_field(values, "target_num_layers", 0, MAX_LAYERS, default=0),
    )


class StandaloneDraft(nn.Module):
    """The draft LM (`lm`, a transformers LlamaForCausalLM) with the config it was built from."""

    def __init__(self, config: DraftModelConfig) -> None:
        super().__init__()
        self.config = config
        self.lm = AutoModelForCausalLM.from_config(config.llama)

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        return self.lm(input_ids=input_ids, **kwargs)
