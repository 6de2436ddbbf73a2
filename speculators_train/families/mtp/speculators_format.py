"""speculators' MTP layout (`MTPDraftModel`, speculators_model_type "mtp"): Qwen3, Qwen3-Next and Qwen3.5 targets,
the normed output fed back (`MTPConfig.style` "qwen3_next"). speculators loads it and trains from it; it is not a
layout vLLM serves (vLLM reads a Qwen3-Next or Qwen3.5 target's own `mtp.*` tensors).

    config.json         speculators_model_type "mtp", architectures ["MTPDraftModel"], transformer_layer_config (the
                        target's text config), num_nextn_predict_layers 1, speculators_config {algorithm "mtp"},
                        speculators_train {num_steps, from_target}
    model.safetensors   mtp_layers.0.{token_layernorm, hidden_layernorm, input_proj, final_layernorm}.weight and the
                        block's tensors under mtp_layers.0., embed_tokens.weight, lm_head.weight (speculators replaces
                        both with the verifier's on load)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from speculators_train.families.base import ExportFormat
from speculators_train.families.format_common import (
    dict_field,
    export_tensors,
    load_checked,
    proposal_config,
    read_weights,
)
from speculators_train.families.mtp.model import MTPDraft, checked_mtp_config
from speculators_train.loading import reading

LAYER = "mtp_layers.0."
# Our modules -> speculators' MTP layer's (the block's own tensors keep their names under the layer).
EXTRAS = {
    "enorm.": "token_layernorm.",
    "hnorm.": "hidden_layernorm.",
    "eh_proj.": "input_proj.",
    "shared_norm.": "final_layernorm.",
}
SHARED = ("embed_tokens.weight", "lm_head.weight")
MODEL_TYPES = ("qwen3", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")  # speculators' `mtp_model_classes`


def our_name(spelled: str) -> str:
    """A file's tensor name as our module names it (a name of neither layout left as it is, to be reported)."""
    if not spelled.startswith(LAYER):
        return spelled
    rest = spelled[len(LAYER) :]
    mine = next((o + rest[len(t) :] for o, t in EXTRAS.items() if rest.startswith(t)), None)
    return mine or "block." + rest


def theirs(name: str) -> str:
    """Our tensor name as the file spells it."""
    if name in SHARED:
        return name
    for ours, spelled in EXTRAS.items():
        if name.startswith(ours):
            return LAYER + spelled + name[len(ours) :]
    return LAYER + name[len("block.") :]


class MTPSpeculatorsFormat(ExportFormat):
    name = "speculators"
    engines = "the `speculators` library (`MTPDraftModel`: Qwen3, Qwen3-Next and Qwen3.5 targets)"

    def detect(self, config: dict[str, Any]) -> bool:
        return config.get("speculators_model_type") == "mtp"

    def unsupported(self, draft: MTPDraft) -> list[str]:
        problems = []
        if draft.config.layer_config["model_type"] not in MODEL_TYPES:
            problems.append(f"speculators' MTPDraftModel builds its layer for {', '.join(MODEL_TYPES)} targets only")
        if draft.config.style != "qwen3_next":
            problems.append(
                "speculators' MTPDraftModel feeds the normed output back: train with draft.style qwen3_next"
            )
        return problems

    def read(self, path: Path, config: dict[str, Any], target_num_layers: int) -> tuple[MTPDraft, bool]:
        config_file = path / "config.json"
        with reading(config_file, "MTP config"):
            layer = dict_field(config, "transformer_layer_config")
            ours = dict_field(config, "speculators_train", {})
            values = {"layer_config": layer, "target_num_layers": target_num_layers, "style": "qwen3_next", **ours}
            cfg = checked_mtp_config(values)
        weights, source = read_weights(path)
        mine = {our_name(name): tensor for name, tensor in weights.items()}
        draft = load_checked(lambda: MTPDraft(cfg), mine, source, config_file, spell=theirs)
        return draft, "embed_tokens.weight" in mine

    def write(
        self, draft: MTPDraft, dtype: str, verifier: str, architectures: list[str], k: int
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        cfg = draft.config
        config = {
            "speculators_model_type": "mtp",
            "architectures": ["MTPDraftModel"],
            "transformer_layer_config": cfg.layer_config,
            "num_nextn_predict_layers": 1,
            "speculators_config": proposal_config("mtp", k, verifier, architectures),
            "speculators_train": {"num_steps": cfg.num_steps, "from_target": cfg.from_target},
            "torch_dtype": dtype,
            "transformers_version": transformers.__version__,
        }
        return config, {theirs(name): t.contiguous() for name, t in export_tensors(draft, dtype).items()}

    def commands(self, out: Path, verifier: str, ev: Any, k: int) -> list[str]:
        return []
