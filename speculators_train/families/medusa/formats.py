"""The Medusa format: one directory that vLLM's Medusa loader and a speculators-style reader both take.

    config.json         model_type "medusa", architectures ["MedusaModel"], hidden_size, vocab_size and
                        truncated_vocab_size (both the target's), num_heads, num_hidden_layers (blocks per head),
                        medusa_fc_bias, original_lm_head false, speculators_train {target_num_layers} (nested:
                        vLLM's MedusaConfig renames every top-level key holding "num" and "layers" to
                        num_hidden_layers, and "num" and "heads" to num_heads), plus speculators_model_type "medusa"
                        and speculators_config {algorithm, proposal_methods, verifier} as `speculators` writes them
    model.safetensors   blocks.{h}.layers.{l}.weight/.bias, lm_heads.{h}.weight [vocab_size, H],
                        token_map (int64: the target id of each draft id)

Why every head is written at the full vocabulary: vLLM 0.32's `Medusa` builds each head at `vocab_size` rows unless
`original_lm_head` (one head shared by all) is set, and when truncated_vocab_size < vocab_size it slices every
head it loads by `token_map` before copying it into that full-size parameter, an assertion that fails for heads of
either size. So truncated_vocab_size equals vocab_size (vLLM then ignores `token_map`), the draft vocabulary's
rows hold the trained heads and every other row is zero: a token outside the draft vocabulary scores logit 0. vLLM
drafts the argmax, which is ours whenever the best draft-vocabulary logit is above 0. `token_map` stays in the
file for readers that restrict the heads again, as ours does when the other rows are all zero.

The reader also takes heads stored at truncated_vocab_size with a `token_map` (earlier exports, other tools), strips
a `medusa_heads.` prefix and takes `original_lm_head: true` as one lm_head shared by every head.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import transformers

from speculators_train.errors import UserError
from speculators_train.families.base import ExportFormat
from speculators_train.families.format_common import (
    DTYPES,
    SPECULATORS_VERSION,
    bool_field,
    dict_field,
    load_checked,
    proposal_config,
    read_weights,
    vllm_serve,
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
        "truncated_vocab_size": config.target_vocab_size,  # full-size heads: see the module docstring
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
    """Block weights and full-vocabulary heads in `dtype` (draft rows at their target ids, zero elsewhere), and the
    int64 `token_map`; d2t/t2d are not written, token_map carries both."""
    token_map = draft_to_target(draft.d2t).to(torch.int64).cpu()
    out = {}
    for name, tensor in draft.state_dict().items():
        if name in ("d2t", "t2d"):
            continue
        tensor = tensor.detach().cpu()
        if name.startswith("lm_heads."):
            full = torch.zeros(draft.config.target_vocab_size, tensor.shape[1], dtype=tensor.dtype)
            full[token_map] = tensor
            tensor = full
        out[name] = tensor.to(DTYPES[dtype]).contiguous()
    out["token_map"] = token_map.contiguous()
    return out


def restricted_heads(
    weights: dict[str, torch.Tensor], token_map: torch.Tensor | None, cfg: MedusaConfig, source: Path
) -> MedusaConfig:
    """For a file whose heads span the full vocabulary and carry a shorter `token_map` (our export): when every row
    outside the map is zero, the heads are restricted to the map's rows in place and the config gets its draft
    vocabulary (what vLLM drafts, but for a draft-vocabulary logit below 0). Otherwise the heads stay full-size and
    the map is dropped, as vLLM ignores it."""
    if token_map is None or cfg.draft_vocab_size != cfg.target_vocab_size or token_map.numel() >= cfg.draft_vocab_size:
        return cfg
    if problem := ids_problem(token_map, "token_map", token_map.numel(), cfg.target_vocab_size):
        raise UserError(f"{source}: {problem}")
    outside = torch.ones(cfg.target_vocab_size, dtype=torch.bool)
    outside[token_map.to(torch.int64)] = False
    heads = [name for name in weights if name.startswith("lm_heads.")]
    full = [weights[n] for n in heads if weights[n].dim() == 2 and weights[n].shape[0] == cfg.target_vocab_size]
    if len(full) != len(heads) or any(bool(w[outside].any()) for w in full):
        weights.pop("token_map", None)
        return cfg
    for name in heads:
        weights[name] = weights[name][token_map.to(torch.int64)]
    return dataclasses.replace(cfg, draft_vocab_size=token_map.numel())


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
    cfg = restricted_heads(weights, weights.get("token_map"), cfg, source)
    token_map = weights.pop("token_map", None)
    if cfg.draft_vocab_size == cfg.target_vocab_size:
        token_map = None  # vLLM reads a token_map only for truncated_vocab_size < vocab_size
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


class MedusaFormat(ExportFormat):
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

    def vllm_speculative_config(self, out: Path, k: int) -> dict[str, Any]:
        return {"model": str(out), "method": "medusa", "num_speculative_tokens": k}

    def commands(self, out: Path, verifier: str, ev: Any, k: int) -> list[str]:
        """vLLM takes Medusa heads only through --speculative-config."""
        return [vllm_serve(verifier, self.vllm_speculative_config(out, k))]
