"""The format engines load a DFlash draft from: speculators' DFlashDraftModel, which vLLM serves as
`method: dflash` (written and read back here).

    config.json         speculators_model_type "dflash", architectures ["DFlashDraftModel"],
                        transformer_layer_config (a Qwen3Config dict: num_hidden_layers = the draft's layers,
                        every layer full attention), draft_vocab_size, target_hidden_size, block_size,
                        aux_hidden_state_layer_ids, mask_token_id, sample_from_anchor false,
                        sliding_window_non_causal true, speculators_config {algorithm "dflash", ...}
    model.safetensors   fc, hidden_norm, layers.N.*, norm, lm_head, d2t (int64), t2d (bool); no embed_tokens
                        (the engine embeds with the target's own table, mask slots included)

vLLM's `update_dflash` gives the target the aux ids as written (they count like ours and EAGLE-3's) and the draft
`target_layer_ids` = id - 1. It also reads `sliding_window_non_causal` as the attention of every draft layer:
`causal = not sliding_window_non_causal`. speculators' own default (false) would make vLLM run the block causally
while speculators trains it bidirectionally; this draft has no sliding-window layer, so writing true changes
nothing for speculators and gives vLLM the bidirectional block it was trained with.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import Qwen3Config

from speculators_train.errors import UserError
from speculators_train.families.base import ExportFormat
from speculators_train.families.block.model import DFlashConfig, DFlashDraft, checked_dflash_config
from speculators_train.families.format_common import (
    FILE_KEYS,
    SPECULATORS_VERSION,
    dict_field,
    export_tensors,
    identity_vocab_maps,
    load_checked,
    proposal_config,
    read_weights,
    shell_arg,
    vllm_serve,
    with_identity_vocab_maps,
)
from speculators_train.loading import reading

ARCHITECTURE = "DFlashDraftModel"


def layer_config(config: DFlashConfig) -> dict[str, Any]:
    """The Qwen3Config dict of the decoder layers as engines rebuild them: RoPE nested and flat (`rope_theta`)."""
    layer = Qwen3Config(**config.layer_config).to_dict()
    for key in FILE_KEYS:
        layer.pop(key, None)
    count = layer["num_hidden_layers"]
    layer.update(
        model_type="qwen3",
        tie_word_embeddings=False,
        layer_types=["full_attention"] * count,
        use_sliding_window=False,
        sliding_window=None,
    )
    rope = layer.get("rope_parameters") or {}
    if "rope_theta" in rope:
        layer["rope_theta"] = rope["rope_theta"]
    return layer


def dflash_config(config: DFlashConfig, verifier: str, architectures: list[str], k: int, dtype: str) -> dict[str, Any]:
    return {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer_config(config),
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "block_size": config.block_size,
        "aux_hidden_state_layer_ids": list(config.aux_layer_ids),
        "mask_token_id": config.mask_token_id,
        "sample_from_anchor": False,
        "sliding_window_non_causal": True,  # vLLM: non-causal blocks (the module docstring)
        "speculators_config": proposal_config("dflash", k, verifier, architectures),
        "tie_word_embeddings": False,
        "dtype": dtype,
        "transformers_version": transformers.__version__,
    }


def load_dflash(
    path: Path,
    config: dict[str, Any],
    target_num_layers: int,
    heads: dict[str, str] | None = None,
    kind: tuple[type[DFlashDraft], Callable[..., DFlashConfig]] = (DFlashDraft, checked_dflash_config),
) -> tuple[DFlashDraft, bool]:
    """A block draft from its speculators files: DFlash's fields, plus `heads` (our field -> the file's key) read
    for `kind`, its (draft type, config reader)."""
    config_file = path / "config.json"
    draft_type, read_config = kind
    with reading(config_file, "DFlash speculators config"):
        layer = dict(dict_field(config, "transformer_layer_config"))
        for key in (*FILE_KEYS, "model_type"):
            layer.pop(key, None)
        for key in ("mask_token_id", "aux_hidden_state_layer_ids"):
            if config.get(key) is None:
                raise UserError(f"{config_file}: {key} is missing; vLLM refuses such a draft too")
        anchored = config.get("sample_from_anchor", draft_type.first_slot == 0)  # speculators' default per type
        if anchored != (draft_type.first_slot == 0):
            raise UserError(
                f"{config_file}: sample_from_anchor is {str(anchored).lower()}; this toolkit reads it "
                f"{str(draft_type.first_slot == 0).lower()} for a {config.get('speculators_model_type')} draft "
                "(true: the anchor slot proposes too, as DSpark trains it)"
            )
        values = {
            "layer_config": layer,
            "target_hidden_size": config.get("target_hidden_size"),
            "draft_vocab_size": config.get("draft_vocab_size"),
            "aux_layer_ids": config["aux_hidden_state_layer_ids"],
            "block_size": config.get("block_size", 8),  # speculators' config default
            "mask_token_id": config["mask_token_id"],
            "target_num_layers": target_num_layers,
            **{field: config.get(key) for field, key in (heads or {}).items()},
        }
        keys = {"layer_config": "transformer_layer_config", "aux_layer_ids": "aux_hidden_state_layer_ids"}
        cfg = read_config(values, {**keys, **(heads or {})})
    weights, source = read_weights(path)
    weights = with_identity_vocab_maps(weights, cfg)
    draft = load_checked(lambda: draft_type(cfg), weights, source, config_file, optional=("embed_tokens.weight",))
    return draft, "embed_tokens.weight" in weights


class DFlashFormat(ExportFormat):
    name = "speculators"
    engines = "vLLM (`vllm serve`, `method: dflash`) and the `speculators` library"

    def detect(self, config: dict[str, Any]) -> bool:
        return config.get("speculators_model_type") == "dflash"

    def read(self, path: Path, config: dict[str, Any], target_num_layers: int) -> tuple[DFlashDraft, bool]:
        return load_dflash(path, config, target_num_layers)

    def write(
        self, draft: DFlashDraft, dtype: str, verifier: str, architectures: list[str], k: int
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        tensors = export_tensors(draft, dtype, skip=("embed_tokens.weight", *identity_vocab_maps(draft)))
        return dflash_config(draft.config, verifier, architectures, k, dtype), tensors

    def vllm_speculative_config(self, out: Path, k: int) -> dict[str, Any]:
        return {"model": str(out), "method": "dflash", "num_speculative_tokens": k}

    def commands(self, out: Path, verifier: str, ev: Any, k: int) -> list[str]:
        return [f"vllm serve {shell_arg(out)}", vllm_serve(verifier, self.vllm_speculative_config(out, k))]
