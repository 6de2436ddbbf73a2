"""The Medusa layout: one directory that vLLM's Medusa loader and a speculators-style reader both take.

    config.json         model_type "medusa", architectures ["MedusaModel"], hidden_size, vocab_size (the target's),
                        num_heads, num_hidden_layers (blocks per head), truncated_vocab_size, medusa_fc_bias,
                        speculators_train {target_num_layers} (nested: vLLM's MedusaConfig renames every top-level
                        key holding "num" and "layers" to num_hidden_layers, and "num" and "heads" to num_heads),
                        plus speculators_model_type "medusa" and speculators_config {algorithm, proposal_methods,
                        verifier} as `speculators` writes them for EAGLE-3
    model.safetensors   blocks.{h}.layers.{l}.weight/.bias, lm_heads.{h}.weight [truncated_vocab_size, H],
                        token_map (int64: the target id of each draft id)

vLLM reads `token_map` only when truncated_vocab_size < vocab_size, and then scatters each head's logits into
the full vocabulary at those ids: the same map as our d2t (token_map = arange + d2t). It strips a
`medusa_heads.` prefix and takes `original_lm_head: true` as one lm_head shared by every head; both are read here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers

from speculators_train.errors import UserError
from speculators_train.families.base import Layout
from speculators_train.families.layouts import DTYPES, SPECULATORS_VERSION, proposal_config, read_weights
from speculators_train.families.medusa.model import MedusaConfig, MedusaDraft
from speculators_train.families.vocab import draft_to_target


def medusa_config(
    config: MedusaConfig, verifier: str, verifier_architectures: list[str], speculative_tokens: int, dtype: str
) -> dict[str, Any]:
    return {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": config.hidden_size,
        "vocab_size": config.target_vocab_size,
        "num_heads": config.num_heads,
        "num_hidden_layers": config.num_layers,
        "truncated_vocab_size": config.draft_vocab_size,
        "medusa_fc_bias": True,
        "original_lm_head": False,
        # Nested: vLLM renames every top-level key holding "num" and "layers" to num_hidden_layers, in file order.
        "speculators_train": {"target_num_layers": config.target_num_layers},
        "speculators_model_type": "medusa",
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": proposal_config("medusa", speculative_tokens, verifier, verifier_architectures),
        "dtype": dtype,
        "transformers_version": transformers.__version__,
    }


def medusa_weights(draft: MedusaDraft, dtype: str) -> dict[str, torch.Tensor]:
    """Head weights in `dtype` and the int64 `token_map`; d2t/t2d are not written, token_map carries both."""
    out = {
        name: tensor.detach().to(DTYPES[dtype]).cpu().contiguous()
        for name, tensor in draft.state_dict().items()
        if name not in ("d2t", "t2d")
    }
    out["token_map"] = draft_to_target(draft.d2t).to(torch.int64).cpu().contiguous()
    return out


def load_medusa(path: Path, config: dict[str, Any]) -> MedusaDraft:
    """Heads from a vLLM Medusa directory (ours or another tool's)."""
    missing = [key for key in ("hidden_size", "vocab_size", "num_heads") if key not in config]
    if missing:
        raise UserError(f"{path / 'config.json'}: not a Medusa config (missing {missing})")
    ours = config.get("speculators_train") or {}  # exports before it was nested carry the key top-level
    vocab = int(config["vocab_size"])
    truncated = int(config.get("truncated_vocab_size") or vocab)
    cfg = MedusaConfig(
        hidden_size=int(config["hidden_size"]),
        num_heads=int(config["num_heads"]),
        num_layers=int(config.get("num_hidden_layers", 1)),
        draft_vocab_size=truncated,
        target_vocab_size=vocab,
        target_num_layers=int(ours.get("target_num_layers") or config.get("target_num_layers") or 0),
    )
    weights = {name.removeprefix("medusa_heads."): t for name, t in read_weights(path).items()}
    if config.get("original_lm_head") and "lm_heads.0.weight" in weights:
        for h in range(1, cfg.num_heads):
            weights.setdefault(f"lm_heads.{h}.weight", weights["lm_heads.0.weight"])
    token_map = weights.pop("token_map", None)
    if token_map is None:
        if truncated != vocab:
            raise UserError(f"{path}: truncated_vocab_size {truncated} < vocab_size {vocab} but no token_map")
        token_map = torch.arange(vocab)
    token_map = token_map.to(torch.int64)
    if token_map.shape != (truncated,) or token_map.min() < 0 or token_map.max() >= vocab:
        raise UserError(
            f"{path}: token_map must hold {truncated} ids of a {vocab}-token vocabulary "
            f"(got shape {tuple(token_map.shape)})"
        )
    weights["d2t"] = token_map - torch.arange(truncated)
    weights["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, token_map, True)
    draft = MedusaDraft(cfg)
    if not config.get("medusa_fc_bias", False):  # bias-free blocks are ours with a zero bias
        for name, param in draft.named_parameters():
            if name.endswith(".bias"):
                weights.setdefault(name, torch.zeros_like(param))
    try:
        missing_names, unexpected = draft.load_state_dict(weights, strict=False)
    except RuntimeError as exc:
        detail = " ".join(str(exc).split("\n\t")[1:2]) or str(exc)
        raise UserError(f"{path}: weights do not fit its config.json ({detail.strip()})") from None
    if missing_names or unexpected:
        raise UserError(f"{path}: weights do not fit Medusa heads (missing {missing_names}, unexpected {unexpected})")
    return draft


class MedusaLayout(Layout):
    name = "speculators"
    engines = "vLLM releases with the `medusa` method (`MedusaModel`), and speculators-style readers"

    def detect(self, config: dict[str, Any]) -> bool:
        return config.get("model_type") == "medusa" or config.get("speculators_model_type") == "medusa"

    def read(self, path: Path, config: dict[str, Any], target_num_layers: int) -> tuple[MedusaDraft, bool]:
        return load_medusa(path, config), False

    def write(
        self, draft: MedusaDraft, dtype: str, verifier: str, architectures: list[str], k: int
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return medusa_config(draft.config, verifier, architectures, k, dtype), medusa_weights(draft, dtype)

    def commands(self, out: Path, verifier: str, ev: Any, k: int) -> list[str]:
        """vLLM takes Medusa heads only through --speculative-config."""
        spec = {"model": str(out), "method": "medusa", "num_speculative_tokens": k}
        return [f"vllm serve {verifier} --speculative-config '{json.dumps(spec)}'"]
