"""A draft from whatever directory a user points at, and the check that it fits a target.

Four layouts are read: this toolkit's checkpoints (`draft_config.json`, EAGLE-3 or Medusa), the speculators/vLLM
EAGLE-3 layout (`speculators_model_type: eagle3`), the SGLang/EAGLE layout (`LlamaForCausalLMEagle3`) and the vLLM
Medusa layout (`model_type: medusa`). `verify` scores any of them, `export` re-exports any of them, `train`
fine-tunes the EAGLE-3 ones (`training.init_from`), and each refuses a draft that does not fit the recipe's target.
"""

from __future__ import annotations

from pathlib import Path

import torch

from speculators_train.errors import UserError
from speculators_train.export import medusa, sglang, speculators
from speculators_train.models.eagle3 import Eagle3Config, Eagle3Draft
from speculators_train.models.medusa import MedusaConfig, MedusaDraft
from speculators_train.training import checkpoint as ckpt


def load_any_draft(path: Path, target_num_layers: int) -> tuple[Eagle3Draft | MedusaDraft, bool, Path]:
    """(draft, whether the files carried `embed_tokens`, the directory actually read). A checkpoints/ or run
    directory of ours resolves to its best checkpoint."""
    if not path.exists():
        raise UserError(f"{path}: no such draft directory")
    if speculators.is_speculators_eagle3(path):
        draft, has_embedding = speculators.load_speculators_eagle3(path, target_num_layers)
        return draft, has_embedding, path
    if sglang.is_sglang_eagle3(path):
        draft, has_embedding = sglang.load_sglang_eagle3(path, target_num_layers)
        return draft, has_embedding, path
    if medusa.is_medusa_export(path):
        return medusa.load_medusa(path), False, path
    resolved = ckpt.resolve_checkpoint(path)
    return ckpt.load_draft(resolved), False, resolved  # ours never store the target's embedding


def fit_problems(config: Eagle3Config | MedusaConfig, hidden_size: int, vocab_size: int, num_layers: int) -> list[str]:
    """Every way a draft's shapes disagree with a target's, each naming what differs."""
    eagle3 = isinstance(config, Eagle3Config)
    problems = [
        f"{name}: draft {mine}, target {theirs}"
        for name, mine, theirs in (
            ("hidden size", config.target_hidden_size if eagle3 else config.hidden_size, hidden_size),
            ("vocab size", config.target_vocab_size, vocab_size),
        )
        if mine != theirs
    ]
    if config.target_num_layers and config.target_num_layers != num_layers:
        problems.append(f"layer count: draft trained on {config.target_num_layers}, target has {num_layers}")
    if eagle3 and max(config.aux_layer_ids) >= num_layers:
        problems.append(f"aux layer ids {config.aux_layer_ids} need < {num_layers} target layers")
    return problems


def check_fits(
    path: Path, config: Eagle3Config | MedusaConfig, hidden_size: int, vocab_size: int, num_layers: int
) -> None:
    problems = fit_problems(config, hidden_size, vocab_size, num_layers)
    if problems:
        raise UserError(f"{path}: draft does not fit the target ({'; '.join(problems)})")


def fill_embedding(draft: Eagle3Draft | MedusaDraft, has_embedding: bool, embed_weight: torch.Tensor) -> None:
    """The target's embedding, unless the draft's files carried their own (vLLM keeps those too); Medusa heads
    have none."""
    if isinstance(draft, Eagle3Draft) and not has_embedding:
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(embed_weight)
