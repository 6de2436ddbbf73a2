"""The layouts vLLM's `method: mtp` loads an MTP head from: the target's own config, and the head's tensors where
the target's checkpoint keeps its MTP layer, by the style the engine runs it in (`settings.Style`).

    config.json         the target's text config with num_nextn_predict_layers 1 (vLLM turns it into the MTP
                        model type of the target's architecture), speculators_train {num_steps, from_target, style}
    model.safetensors   style deepseek (DeepSeek-V3's layout, which GLM-4.5 and MiMo share):
                            model.layers.{n}.{enorm, hnorm, eh_proj, shared_head.norm}.weight and the block's tensors
                            under model.layers.{n}., n = num_hidden_layers
                        style qwen3_next (Qwen3-Next's and Qwen3.5's):
                            mtp.{pre_fc_norm_embedding, pre_fc_norm_hidden, fc, norm}.weight and the block's tensors
                            under mtp.layers.0.
                        the block's tensors as the target's class names them in its checkpoint;
                        model.embed_tokens.weight and lm_head.weight (vLLM's MTP loaders read both as the head's
                        shared embedding and head);
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
from speculators_train.families.mtp.settings import STYLE_CLASSES
from speculators_train.loading import reading

SHARED = {"embed_tokens.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight"}
EXTRAS_OURS = ("enorm.", "hnorm.", "eh_proj.", "shared_norm.")  # our modules around the block
QWEN_PREFIX = "mtp."  # where Qwen3-Next's and Qwen3.5's checkpoints keep the MTP layer


def layout(style: str, n: int) -> tuple[dict[str, str], str]:
    """(our modules -> the file's names, the block's prefix) in `style`'s layout for a target of n layers."""
    if style == "qwen3_next":
        names = ("pre_fc_norm_embedding.", "pre_fc_norm_hidden.", "fc.", "norm.")
        return dict(zip(EXTRAS_OURS, (QWEN_PREFIX + name for name in names), strict=True)), QWEN_PREFIX + "layers.0."
    names = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
    return dict(zip(EXTRAS_OURS, (f"model.layers.{n}.{name}" for name in names), strict=True)), f"model.layers.{n}."


def to_files(draft: MTPDraft, dtype: str) -> dict[str, torch.Tensor]:
    n = draft.config.target_num_layers
    extras, block_prefix = layout(draft.config.style, n)
    tensors = export_tensors(draft, dtype)
    block = {name[len("block.") :]: t for name, t in tensors.items() if name.startswith("block.")}
    out = {SHARED[name]: t for name, t in tensors.items() if name in SHARED}
    for ours, theirs in extras.items():
        out.update({theirs + name[len(ours) :]: t for name, t in tensors.items() if name.startswith(ours)})
    in_target = f"model.layers.{n}."  # where `block_to_checkpoint` puts them
    for name, tensor in block_to_checkpoint(block, draft.config.text).items():
        out[block_prefix + name[len(in_target) :]] = tensor.contiguous()
    return out


def from_files(weights: dict[str, torch.Tensor], text: Any, n: int) -> dict[str, torch.Tensor]:
    """Our state dict from an export's or a target's tensors in either layout (the target's other layers
    ignored)."""
    style = "qwen3_next" if any(name.startswith(QWEN_PREFIX) for name in weights) else "deepseek"
    extras, block_prefix = layout(style, n)
    out = {ours: weights[theirs] for ours, theirs in SHARED.items() if theirs in weights}
    layer_prefix = QWEN_PREFIX if style == "qwen3_next" else block_prefix  # the block's and its extras' tensors
    layer = {name: t for name, t in weights.items() if name.startswith(layer_prefix)}
    for ours, theirs in extras.items():
        for name in [name for name in layer if name.startswith(theirs)]:
            out[ours + name[len(theirs) :]] = layer.pop(name)
    layer = {name: t for name, t in layer.items() if not name.startswith(block_prefix + "shared_head.head")}
    if others := sorted(name for name in layer if not name.startswith(block_prefix)):
        raise ValueError(f"tensors of MTP layers past the first, which are not read here: {', '.join(others[:3])}")
    in_target = f"model.layers.{n}."  # where `block_from_checkpoint` reads them
    block = {in_target + name[len(block_prefix) :]: t for name, t in layer.items()}
    if block:
        out.update({"block." + name: t for name, t in block_from_checkpoint(block, text, block_prefix).items()})
    return out


class MTPFormat(ExportFormat):
    name = "mtp"
    engines = "vLLM (`method: mtp`, for targets with an MTP model class: DeepSeek-V3, GLM-4.5, Qwen3-Next, ...)"

    def detect(self, config: dict[str, Any]) -> bool:
        return "num_nextn_predict_layers" in config and "speculators_train" in config

    def read(self, path: Path, config: dict[str, Any], target_num_layers: int) -> tuple[MTPDraft, bool]:
        config_file = path / "config.json"
        with reading(config_file, "MTP config"):
            ours = dict_field(config, "speculators_train")
            layer = {k: v for k, v in config.items() if k not in ("speculators_train", "num_nextn_predict_layers")}
            cfg = checked_mtp_config({"layer_config": layer, "target_num_layers": target_num_layers, **ours})
        weights, source = read_weights(path)
        with reading(source, "MTP weights"):
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
            "speculators_train": {"num_steps": cfg.num_steps, "from_target": cfg.from_target, "style": cfg.style},
            "torch_dtype": dtype,
            "transformers_version": transformers.__version__,
        }
        return config, to_files(draft, dtype)

    def vllm_mtp_classes(self, draft: MTPDraft) -> tuple[str, ...]:
        return STYLE_CLASSES[draft.config.style]

    def vllm_speculative_config(self, out: Path, k: int) -> dict[str, Any]:
        return {"model": str(out), "method": "mtp", "num_speculative_tokens": k}

    def commands(self, out: Path, verifier: str, ev: Any, k: int) -> list[str]:
        return [vllm_serve(verifier, self.vllm_speculative_config(out, k))]
