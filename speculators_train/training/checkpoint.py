"""Training checkpoints: the draft (`families.drafts.save_draft`), optimizer/scheduler/RNG via torch.save loaded
with weights_only=True (never unpickling code), and a JSON trainer state with the exact data position; the names
of their files and pointers are `layout.py`'s.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from speculators_train.families.drafts import save_draft
from speculators_train.files import atomic_write_json, to_json, writing
from speculators_train.layout import (
    BEST,
    LATEST,
    OPTIMIZER,
    TRAINER_STATE,
    read_pointer,
    shard_staging,
    shard_stagings,
    step_dir,
    step_dirs,
)
from speculators_train.loading import load_torch_state, read_json_object


def save_checkpoint(
    root: Path,
    step: int,
    draft: nn.Module,
    optimizer_state: dict[str, Any] | None,
    state: dict[str, Any],
    keep_last: int,
    weights: dict[str, torch.Tensor] | None = None,
    shards: Path | None = None,
) -> Path:
    """Write into a temporary directory, then rename into place; a kill at any point leaves a complete
    checkpoint under every name `LATEST` can point at (re-saving a step moves the old copy aside first).
    `weights`: the draft's whole tensors where its own are shards; `shards`: a directory of per-rank files
    (`stage_shards`) moved in with the rest."""
    for stale in root.glob(".step-*"):  # left by a save that was killed
        shutil.rmtree(stale, ignore_errors=True)
    final = step_dir(root, step)
    tmp = root / f".step-{step:06d}.tmp-{os.getpid()}"
    tmp.mkdir(parents=True)
    with writing(final, cleanup=tmp):
        save_draft(tmp, draft, weights)
        for shard in sorted(shards.iterdir()) if shards is not None else ():
            os.replace(shard, tmp / shard.name)
        if optimizer_state is not None:
            torch.save(optimizer_state, tmp / OPTIMIZER)
        (tmp / TRAINER_STATE).write_text(to_json(state, indent=2))
    old = root / f".step-{step:06d}.old-{os.getpid()}"
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    if shards is not None:
        shutil.rmtree(shards, ignore_errors=True)
    atomic_write_json(root / LATEST, {"step": step})
    _prune(root, keep_last)
    return final


def stage_shards(root: Path, step: int) -> Path:
    """Where each rank writes its file of a checkpoint before rank 0 moves them in (rank 0 calls this, between
    barriers; a directory left by a killed save is removed first). Every rank must see `root`: a shared
    filesystem across nodes."""
    for stale in shard_stagings(root):
        shutil.rmtree(stale, ignore_errors=True)
    staging = shard_staging(root, step)
    staging.mkdir(parents=True)
    return staging


def _prune(root: Path, keep_last: int) -> None:
    best = read_pointer(root / BEST)
    for step in step_dirs(root)[:-keep_last]:
        if best is None or step != best["step"]:
            shutil.rmtree(step_dir(root, step), ignore_errors=True)


def load_training_state(path: Path) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Optimizer/scheduler/RNG state (None if the checkpoint has none) and the trainer's JSON state."""
    state = read_json_object(path / TRAINER_STATE, "trainer state")
    optimizer_file = path / OPTIMIZER
    if not optimizer_file.is_file():
        return None, state
    return load_torch_state(optimizer_file, "optimizer state"), state
