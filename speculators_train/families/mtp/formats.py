"""The layout vLLM's `method: mtp` loads an MTP head from (DeepSeek-V3's, which GLM-4.5 and MiMo share): the
target's own config and the head as the target's extra layer n = num_hidden_layers.

    config.json         the target's text config with num_nextn_predict_layers 1 (vLLM turns it into the MTP
                        model type of the target's architecture), speculators_train {num_steps, from_target}
    model.safetensors   model.layers.{n}.{enorm, hnorm, eh_proj, shared_head.norm}.weight, the block's tensors
                        under model.layers.{n}. as the target's class names them, model.embed_tokens.weight and
                        lm_head.weight (vLLM's MTP loader reads both as the head's shared embedding and head);
                        speculators_train.from_target: whether training started from the target's own MTP layer
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from speculators_train.families.base import ExportFormat
from speculators_train.families.format_common import dict_field, export_tensors, load_checked, read_weights, vllm_serve
from speculators_train.families.mtp.checkpoint import block_from_checkpoint, block_to_checkpoint
from speculators_train.families.mtp.model import MTPDraft, checked_mtp_config
from speculators_train.loading import reading

# Our modules -> the DeepSeek MTP layer's, under model.layers.{n}. (the block's own tensors: `checkpoint.py`).
EXTRAS = {"enorm.": "enorm.", "hnorm.": "hnorm.", "eh_proj.": "eh_proj.", "shared_norm.": "shared_head.norm."}
SHARED = {"embed_tokens.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight"}


def to_files(draft: MTPDraft, dtype: str) -> dict[str, torch.Tensor]:
    text, prefix = draft.config.text, f"model.layers.{draft.config.target_num_layers}."
    tensors = export_tensors(draft, dtype)
    block = {name[len("block.") :]: t for name, t in tensors.items() if name.startswith("block.")}
    out = {SHARED[name]: t for name, t in tensors.items() if name in SHARED}
    for ours, theirs in EXTRAS.items():
        out.update({prefix + theirs + n[len(ours) :]: t for n, t in tensors.items() if n.startswith(ours)})
    return {**out, **{name: t.contiguous() for name, t in block_to_checkpoint(block, text).items()}}


def from_files(weights: dict[str, torch.Tensor], text: Any, n: int) -> dict[str, torch.Tensor]:
    """Our state dict from an export's or a target's tensors (the target's other layers ignored)."""
    prefix = f"model.layers.{n}."
    out = {ours: weights[theirs] for ours, theirs in SHARED.items() if theirs in weights}
    layer = {name: t for name, t in weights.items() if name.startswith(prefix)}
    for ours, theirs in EXTRAS.items():
        for name in [name for name in layer if name.startswith(prefix + theirs)]:
            out[ours + name[len(prefix + theirs) :]] = layer.pop(name)
    layer = {name: t for name, t in layer.items() if not name.startswith(prefix + "shared_head.head")}
    if layer:
        out.update({"block." + name: t for name, t in block_from_checkpoint(layer, text).items()})
    return out


class MTPFormat(ExportFormat):
    name = "mtp"
    engines = "vLLM (`method: mtp`, for targets with an MTP model class: DeepSeek-V3, GLM-4.5, MiMo, ...)"

    def detect(self, config: dict[str, Any]) -> bool:
        return "num_nextn_predict_layers" in config and "speculators_train" in config

    def read(self, path: Path, config: dict[str, Any], target_num_layers: int) -> tuple[MTPDraft, bool]:
        config_file = path / "config.json"
        with reading(config_file, "MTP config"):
            ours = dict_field(config, "speculators_train")
            layer = {k: v for k, v in config.items() if k not in ("speculators_train", "num_nextn_predict_layers")}
            cfg = checked_mtp_config({"layer_config": layer, "target_num_layers": target_num_layers, **ours})
        weights, source = read_weights(path)
        mine = from_files(weights, cfg.text, cfg.target_num_layers)
        return load_checked(lambda: MTPDraft(cfg), mine, source, config_file), "embed_tokens.weight" in mine

    def write(
        self, draft: MTPDraft, dtype: str, verifier: str, architectures: list[str], k: int
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        cfg = draft.config
        config = {
            **cfg.layer_config,
            "architectures": architectures,
            "num_nextn_predict_layers": 1,
            "speculators_train": {"num_steps": cfg.num_steps, "from_target": cfg.from_target},
            "torch_dtype": dtype,
            "transformers_version": transformers.__version__,
        }
        return config, to_files(draft, dtype)

    def vllm_speculative_config(self, out: Path, k: int) -> dict[str, Any]:
        return {"model": str(out), "method": "mtp", "num_speculative_tokens": k}

    def commands(self, out: Path, verifier: str, ev: Any, k: int) -> list[str]:
        return [vllm_serve(verifier, self.vllm_speculative_config(out, k))]
