"""Checkpoints: draft weights in safetensors, optimizer/scheduler/RNG via torch.save loaded with
weights_only=True (never unpickling code), and a JSON trainer state with the exact data position.

    checkpoints/step-000120/{model.safetensors, draft_config.json, optimizer.pt, trainer_state.json}
    checkpoints/latest.json  -> {"step": 120}        (rewritten atomically after the directory lands)
    checkpoints/best.json    -> {"step": 80, "metric": ..., "value": ...}
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from speculators_train.errors import UserError
from speculators_train.files import atomic_write_json, read_json
from speculators_train.models.eagle3 import Eagle3Config, Eagle3Draft
from speculators_train.models.medusa import MedusaConfig, MedusaDraft

# The target's embedding is frozen and large; it is restored from the target, not stored per checkpoint.
NOT_SAVED = ("embed_tokens.weight",)


def draft_state_dict(draft: Eagle3Draft | MedusaDraft) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in draft.state_dict().items() if k not in NOT_SAVED}


def save_checkpoint(
    root: Path,
    step: int,
    draft: Eagle3Draft | MedusaDraft,
    optimizer_state: dict[str, Any] | None,
    state: dict[str, Any],
    keep_last: int,
) -> Path:
    """Write into a temporary directory, then rename into place; a kill at any point leaves a complete
    checkpoint under every name `latest.json` can point at (re-saving a step moves the old copy aside first)."""
    for stale in root.glob(".step-*"):  # left by a save that was killed
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".step-{step:06d}.tmp-{os.getpid()}"
    tmp.mkdir(parents=True)
    save_file(draft_state_dict(draft), tmp / "model.safetensors")
    (tmp / "draft_config.json").write_text(json.dumps(draft.config.to_dict(), indent=2))
    if optimizer_state is not None:
        torch.save(optimizer_state, tmp / "optimizer.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
    old = root / f".step-{step:06d}.old-{os.getpid()}"
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    atomic_write_json(root / "latest.json", {"step": step})
    _prune(root, keep_last)
    return final


def _prune(root: Path, keep_last: int) -> None:
    best = read_pointer(root / "best.json")
    steps = sorted(int(p.name[5:]) for p in root.glob("step-*") if p.is_dir())
    for step in steps[:-keep_last]:
        if best is None or step != best["step"]:
            shutil.rmtree(root / f"step-{step:06d}", ignore_errors=True)


def read_pointer(path: Path) -> dict[str, Any] | None:
    return read_json(path, "checkpoint pointer") if path.is_file() else None


def _complete(path: Path) -> bool:
    return all((path / name).is_file() for name in ("model.safetensors", "draft_config.json", "trainer_state.json"))


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint `latest.json` names; if that one is gone or incomplete, the newest complete one."""
    pointer = read_pointer(root / "latest.json")
    if pointer is not None:
        path = root / f"step-{int(pointer['step']):06d}"
        if _complete(path):
            return path
    complete = sorted((p for p in root.glob("step-*") if _complete(p)), key=lambda p: p.name)
    return complete[-1] if complete else None


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint directory itself, or a checkpoints/ (or run) directory: its best, else its latest."""
    if (path / "draft_config.json").is_file():
        return path
    for root in (path, path / "checkpoints", path / "train" / "checkpoints"):
        pointer = read_pointer(root / "best.json") if (root / "best.json").is_file() else None
        if pointer is not None and (root / f"step-{int(pointer['step']):06d}").is_dir():
            return root / f"step-{int(pointer['step']):06d}"
        latest = latest_checkpoint(root) if root.is_dir() else None
        if latest is not None:
            return latest
    raise UserError(f"{path}: no draft checkpoint there (expected draft_config.json, or checkpoints with best.json)")


def load_draft(path: Path, embed_weight: torch.Tensor | None = None) -> Eagle3Draft | MedusaDraft:
    """Rebuild a draft (EAGLE-3, or Medusa heads) from a checkpoint directory (safetensors only: nothing is
    unpickled)."""
    saved = read_json(path / "draft_config.json", "draft config")
    medusa = isinstance(saved, dict) and saved.get("architecture") == "medusa"
    try:
        config = MedusaConfig(**saved) if medusa else Eagle3Config(**saved)
    except TypeError as exc:
        raise UserError(f"{path / 'draft_config.json'}: not a draft config of this toolkit ({exc})") from None
    weights = load_draft_weights(path)
    draft = MedusaDraft(config) if medusa else Eagle3Draft(config)
    missing, unexpected = draft.load_state_dict(weights, strict=False)
    missing = [k for k in missing if k not in NOT_SAVED]
    if missing or unexpected:
        raise UserError(f"{path}: weights do not fit the draft (missing {missing}, unexpected {unexpected})")
    if embed_weight is not None and isinstance(draft, Eagle3Draft):
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(embed_weight)
    return draft


def load_draft_weights(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path / "model.safetensors")
    except OSError as exc:
        raise UserError(f"{path / 'model.safetensors'}: unreadable checkpoint weights ({exc})") from None


def load_training_state(path: Path) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Optimizer/scheduler/RNG state (None if the checkpoint has none) and the trainer's JSON state."""
    state = read_json(path / "trainer_state.json", "trainer state")
    optimizer_file = path / "optimizer.pt"
    if not optimizer_file.is_file():
        return None, state
    try:
        return torch.load(optimizer_file, map_location="cpu", weights_only=True), state
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError for damaged files
        raise UserError(f"{optimizer_file}: unreadable optimizer state ({exc})") from None
