"""A standalone draft: a causal LM of the target's family and tokenizer, with its own KV cache at inference.

    logits_t = lm(x_0 .. x_t)      predicts x_{t+1}; trained toward the target's distribution for x_{t+1}

The LM is of the target's own text model type (a Qwen3 target gets a Qwen3 draft, gpt-oss a gpt-oss one, with
their layer types), built from its config class: `model_config` holds that config as a dict, `model_type` in it.
Its output layer covers the target's whole vocabulary (engines verify draft ids as target ids), and is never tied
to its embedding here, so each can be trained and every engine reads the same two matrices.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from speculators_train.errors import UserError
from speculators_train.families.draft_config import Bounded, Vocab, checked, draft_config
from speculators_train.families.eagle.model import check_layer
from speculators_train.families.format_common import FILE_KEYS, MAX_HIDDEN, MAX_LAYERS, shown
from speculators_train.files import finite

MAX_DRAFT_LAYERS = 256  # a draft deeper than this is no draft


class DraftDepth(BaseModel):
    """The draft LM's layer count, beside the values `check_layer` reads from its LlamaConfig."""

    model_config = ConfigDict(extra="allow")

    num_hidden_layers: Bounded(1, MAX_DRAFT_LAYERS)


@draft_config
class DraftModelConfig:
    model_config: dict[str, Any]  # the draft LM's config, as a dict; its `model_type` a causal LM of transformers
    target_vocab_size: Vocab  # the draft's own vocabulary: engines verify its ids as the target's
    target_hidden_size: Bounded(0, MAX_HIDDEN) = 0  # 0: it reads no target state, so any target width fits
    target_num_layers: Bounded(0, MAX_LAYERS) = 0  # 0: not recorded

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def lm_config(self) -> Any:
        values = dict(self.model_config)
        return AutoConfig.for_model(values.pop("model_type", "llama"), **values)


def lm_values(values: dict[str, Any]) -> dict[str, Any]:
    """A config dict without the keys that describe a saved file (`FILE_KEYS`)."""
    return {k: v for k, v in values.items() if k not in FILE_KEYS}


def model_config(config: Any) -> dict[str, Any]:
    """The config dict of a draft LM shaped as `config` (a causal LM's transformers config), untied."""
    values = {**lm_values(config.to_dict()), "model_type": config.model_type}
    if odd := [k for k, v in values.items() if finite(v) != v]:
        # strict JSON holds no infinity: a value the class defaults to (Nemotron-H's `time_step_limit`, (0, inf)) is
        # left for the class to restore; any other cannot be written
        defaults = type(config)().to_dict()
        if kept := [k for k in odd if values[k] != defaults.get(k)]:
            raise UserError(f"the draft's config sets {kept[0]} to {values[kept[0]]}, which JSON cannot hold")
        values = {k: v for k, v in values.items() if k not in odd}
    # the layer count written out: a config that derives it from its per-layer list (Nemotron-H) leaves it out of
    # its dict
    return {**values, "num_hidden_layers": config.num_hidden_layers, "tie_word_embeddings": False}


def causal_lm_type(model_type: Any) -> str:
    """`model_type` if transformers has a causal LM of that type (what a saved draft may name), else ValueError."""
    if not isinstance(model_type, str) or model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"model_config.model_type {shown(model_type)} is not a causal LM transformers knows")
    return model_type


def checked_config(values: dict[str, Any]) -> DraftModelConfig:
    """A DraftModelConfig from a saved file, each value typed and in range before anything is built."""
    layer = values.get("model_config")
    if isinstance(layer, dict):
        causal_lm_type(layer.get("model_type", "llama"))
        check_layer(layer, "model_config.")  # the values every decoder config shares, typed and in range
        checked(DraftDepth, layer, prefix="model_config.")
        if layer.get("tie_word_embeddings"):
            raise ValueError("model_config.tie_word_embeddings must be false: the draft's head is its own")
    config = checked(DraftModelConfig, values)
    if config.model_config["vocab_size"] != config.target_vocab_size:
        raise ValueError(
            f"model_config.vocab_size {config.model_config['vocab_size']} must be the target's "
            f"{config.target_vocab_size}"
        )
    return config


class StandaloneDraft(nn.Module):
    """The draft LM (`lm`, a transformers causal LM of its config's type) with the config it was built from."""

    def __init__(self, config: DraftModelConfig) -> None:
        super().__init__()
        self.config = config
        self.lm = AutoModelForCausalLM.from_config(config.lm_config)

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        return self.lm(input_ids=input_ids, **kwargs)
