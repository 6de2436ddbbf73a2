"""The MTP block's tensors in a checkpoint's names and layouts (as the target's own files hold its MTP layer, per
expert where transformers fuses experts), to and from the module's: transformers' own weight conversions do it, so
every architecture it loads is read as it reads it."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from transformers.core_model_loading import revert_weight_conversion
from transformers.utils import logging as hf_logging

from speculators_train.families.mtp.model import mtp_layer_config, per_layer_lists
from speculators_train.head import meta_model
from speculators_train.loading import open_tensors
from speculators_train.origin import _weight_map


def block_to_checkpoint(block: dict[str, torch.Tensor], text: Any) -> dict[str, torch.Tensor]:
    """The block's state dict as the target's checkpoint holds layer n = num_hidden_layers."""
    n = text.num_hidden_layers
    named = {f"model.layers.{n}.{name}": tensor for name, tensor in block.items()}
    return revert_weight_conversion(meta_model(mtp_layer_config(text)), named)


def one_layer_config(text: Any) -> Any:
    """The target's config cut to one layer of the kind its MTP slot n holds (dense or MoE)."""
    config = mtp_layer_config(text)
    n = config.num_hidden_layers - 1
    for name in per_layer_lists(config):
        setattr(config, name, getattr(config, name)[n:])
    config.num_hidden_layers = 1
    if getattr(config, "first_k_dense_replace", None) is not None:  # DeepSeek, GLM: MoE from this layer on
        config.first_k_dense_replace = 0 if n >= config.first_k_dense_replace else 1
    return config


def block_from_checkpoint(tensors: dict[str, torch.Tensor], text: Any, spelled: str) -> dict[str, torch.Tensor]:
    """The block's state dict from layer n's checkpoint tensors (`model.layers.{n}.` names, the MTP-only ones
    removed): loaded by transformers into a one-layer model of the target's class, so its conversions apply.
    `spelled`: the layer's prefix in the file, for the error naming a tensor that does not fit."""
    n = text.num_hidden_layers
    prefix = f"model.layers.{n}."
    one = one_layer_config(text)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        save_file({"model.layers.0." + k[len(prefix) :]: v.contiguous() for k, v in tensors.items()},
                  folder / "model.safetensors", metadata={"format": "pt"})  # fmt: skip
        (folder / "config.json").write_text(json.dumps(one.to_dict()))
        level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()  # its report lists the embedding, head and norm this file lacks by design
        hf_logging.disable_progress_bar()
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                folder, config=one, dtype=torch.float32, output_loading_info=True
            )
        finally:
            hf_logging.set_verbosity(level)
            if bars:
                hf_logging.enable_progress_bar()
    wrong = [k for k in (*info["missing_keys"], *info["unexpected_keys"]) if k.startswith("model.layers.")]
    if wrong or info["mismatched_keys"]:
        raise ValueError(
            f"the MTP layer's tensors do not fit a {type(model).__name__} layer: "
            f"{', '.join(sorted(w.replace('model.layers.0.', spelled) for w in wrong)) or info['mismatched_keys']}"
        )
    layer = model.get_decoder().layers[0]
    return {name: tensor.detach().clone() for name, tensor in layer.state_dict().items()}


def target_mtp_tensors(target_dir: Path, n: int) -> dict[str, torch.Tensor]:
    """The target checkpoint's MTP layer as stored (`model.layers.{n}.*` for DeepSeek-V3 and GLM-4.5, `mtp.*` for
    Qwen3-Next and Qwen3.5, which transformers drops on load); {} when the target ships none."""
    weight_map = _weight_map(target_dir)
    prefixes = (f"model.layers.{n}.", "mtp.")
    if weight_map:
        files = sorted({f for k, f in weight_map.items() if k.startswith(prefixes)})
    else:
        files = ["model.safetensors"]
    out: dict[str, torch.Tensor] = {}
    for name in files:
        with open_tensors(target_dir / name, "target weights") as fh:
            out.update({k: fh.get_tensor(k).float() for k in fh.keys() if k.startswith(prefixes)})  # noqa: SIM118
    return out
