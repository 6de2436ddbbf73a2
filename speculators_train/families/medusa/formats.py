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
from speculators_train.families.layouts import (
    DTYPES,
    SPECULATORS_VERSION,
    bool_field,
    dict_field,
    load_checked,
    proposal_config,
    read_weights,
)
from speculators_train.families.medusa.model import MedusaConfig, MedusaDraft, checked_config
from speculators_train.families.vocab import draft_to_target, ids_problem
from speculators_train.loading import reading


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
    config_file = path / "config.json"
    with reading(config_file, "Medusa config"):
        ours = dict_field(config, "speculators_train", default={})  # exports before it was nested: top-level
        target_layers = ours.get("target_num_layers", config.get("target_num_layers"))
        vocab = config.get("vocab_size")
        truncated = config.get("truncated_vocab_size")
        cfg = checked_config(
            {
                "hidden_size": config.get("hidden_size"),
                "num_heads": config.get("num_heads"),
                "num_layers": config.get("num_hidden_layers", 1),
                "draft_vocab_size": vocab if truncated is None else truncated,
                "target_vocab_size": vocab,
                "target_num_layers": target_layers,
            },
            {
                "num_layers": "num_hidden_layers",
                "draft_vocab_size": "truncated_vocab_size",
                "target_vocab_size": "vocab_size",
                "target_num_layers": "speculators_train.target_num_layers",
            },
        )
        shared_head = bool_field(config, "original_lm_head", False)
        bias = bool_field(config, "medusa_fc_bias", False)
    weights, source = read_weights(path)
    weights = {name.removeprefix("medusa_heads."): t for name, t in weights.items()}
    if shared_head and "lm_heads.0.weight" in weights:
        for h in range(1, cfg.num_heads):
            weights.setdefault(f"lm_heads.{h}.weight", weights["lm_heads.0.weight"])
    token_map = weights.pop("token_map", None)
    if token_map is None:
        if cfg.draft_vocab_size != cfg.target_vocab_size:
            raise UserError(
                f"{path}: truncated_vocab_size {cfg.draft_vocab_size} < vocab_size {cfg.target_vocab_size} "
                "but no token_map"
            )
        token_map = torch.arange(cfg.target_vocab_size)
    elif problem := ids_problem(token_map, "token_map", cfg.draft_vocab_size, cfg.target_vocab_size):
        raise UserError(f"{source}: {problem}")
    weights["d2t"] = token_map.to(torch.int64) - torch.arange(cfg.draft_vocab_size)
    if not bias:  # bias-free blocks are ours with a zero bias
        for h in range(cfg.num_heads):
            for block in range(cfg.num_layers):
                weights.setdefault(f"blocks.{h}.layers.{block}.bias", torch.zeros(cfg.hidden_size))
    return load_checked(lambda: MedusaDraft(cfg), weights, source, config_file)


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
