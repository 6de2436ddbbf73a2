"""The speculators layout of an EAGLE-shaped draft (config.json fields and weight names), which EAGLE-3's and
P-EAGLE's speculators formats both write and read; see `families/eagle3/formats.py` for the file itself."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import LlamaConfig

from speculators_train.errors import UserError
from speculators_train.families.eagle.model import Eagle3Config, Eagle3Draft
from speculators_train.families.format_common import (
    FILE_KEYS,
    SPECULATORS_VERSION,
    dict_field,
    load_checked,
    proposal_config,
    with_identity_vocab_maps,
)

# LlamaConfig.to_dict() keys that describe a saved file rather than the layer.


def layer_config(config: Eagle3Config) -> dict[str, Any]:
    """The full LlamaConfig dict of the single decoder layer, as engines rebuild it: RoPE both nested
    (`rope_parameters`, newer vLLM) and flat (`rope_theta`, and `rope_scaling` unless default), which older vLLM
    and SGLang read, falling back to theta 10000 without them."""
    layer = LlamaConfig(**config.layer_config).to_dict()
    for key in FILE_KEYS:
        layer.pop(key, None)
    layer.update(model_type="llama", num_hidden_layers=1, tie_word_embeddings=False)
    rope = layer.get("rope_parameters") or {}
    if "rope_theta" in rope:
        layer["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default":
        layer["rope_scaling"] = dict(rope)
    return layer


def speculators_config(
    config: Eagle3Config, verifier: str, verifier_architectures: list[str], speculative_tokens: int, dtype: str
) -> dict[str, Any]:
    """config.json as `speculators` 0.9.0 writes it for EAGLE-3 (no top-level model_type: vLLM detects the
    format from `speculators_model_type`)."""
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": {**layer_config(config), "architectures": ["LlamaForCausalLM"]},
        "draft_vocab_size": config.draft_vocab_size,
        "norm_before_residual": config.norm_before_residual,  # always written: vLLM reads a missing key as true
        "target_hidden_size": config.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
        "norm_before_fc": config.norm_before_fc,
        "fc_norm": False,
        "norm_output": config.norm_output,
        "embed_requires_grad": False,
        "speculators_config": proposal_config("eagle3", speculative_tokens, verifier, verifier_architectures),
        "dtype": dtype,
        "transformers_version": transformers.__version__,
    }


def speculators_fields(
    config: dict[str, Any], config_file: Path, target_num_layers: int
) -> tuple[dict[str, Any], dict[str, str]]:
    """The Eagle3Config fields a speculators-format config.json describes (to be checked by `checked_config`), and
    how the file spells those that it names differently. Call inside `reading(config_file, ...)`."""
    layer = dict_field(config, "transformer_layer_config")
    if config.get("fc_norm"):
        raise UserError(f"{config_file}: fc_norm is set; this draft class has no norm per target state")
    n = target_num_layers
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    values = {
        "layer_config": clean_layer_config(layer),
        "target_hidden_size": config.get("target_hidden_size"),
        "draft_vocab_size": config.get("draft_vocab_size"),
        "aux_layer_ids": [2, n // 2, n - 3] if aux is None else aux,
        "norm_before_residual": config.get("norm_before_residual", True),  # missing: true, as vLLM reads it
        "norm_before_fc": config.get("norm_before_fc", False),
        "norm_output": config.get("norm_output", False),
    }
    return values, {"layer_config": "transformer_layer_config", "aux_layer_ids": "eagle_aux_hidden_state_layer_ids"}


def clean_layer_config(layer: dict[str, Any]) -> dict[str, Any]:
    """A layer config read from someone's file, reduced to what rebuilds one Llama decoder layer."""
    layer = dict(layer)
    for key in (*FILE_KEYS, "model_type", "layer_types", "mlp_layer_types"):
        layer.pop(key, None)
    layer.update(num_hidden_layers=1, tie_word_embeddings=False)
    return layer


def load_eagle3(
    config: Eagle3Config,
    weights: dict[str, torch.Tensor],
    source: Path,
    config_file: Path,
    spell: Callable[[str], str] = str,
    draft_type: type[Eagle3Draft] = Eagle3Draft,
) -> tuple[Eagle3Draft, bool]:
    """The draft (`draft_type`, an Eagle3Draft or a draft extending it) holding `weights` (names in our = the
    speculators format; `spell` gives the file's) once they fit `config`, and whether they carried `embed_tokens`.
    A full-vocabulary draft may ship no d2t: its map is the identity."""
    weights = with_identity_vocab_maps(weights, config)
    draft = load_checked(
        lambda: draft_type(config), weights, source, config_file, optional=("embed_tokens.weight",), spell=spell
    )
    return draft, "embed_tokens.weight" in weights
