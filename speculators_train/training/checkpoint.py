"""Training checkpoints: the draft (`families.drafts.save_draft`), optimizer/scheduler/RNG via torch.save loaded
with weights_only=True (never unpickling code), and a JSON trainer state with the exact data position.

    checkpoints/step-000120/{model.safetensors, draft_config.json, optimizer.pt, trainer_state.json}
        (+ optimizer-rank00000-of-00002.pt, ... under FSDP: each rank's slice of the Adam moments)
    checkpoints/latest.json  -> {"step": 120}        (rewritten atomically after the directory lands)
    checkpoints/best.json    -> {"step": 80, "metric": ..., "value": ...}
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from speculators_train.families.drafts import read_pointer, save_draft
from speculators_train.files import atomic_write_json, to_json, writing
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
    checkpoint under every name `latest.json` can point at (re-saving a step moves the old copy aside first).
    `weights`: the draft's whole tensors where its own are shards; `shards`: a directory of per-rank files
    (`stage_shards`) moved in with the rest."""
    for stale in root.glob(".step-*"):  # left by a save that was killed
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".step-{step:06d}.tmp-{os.getpid()}"
    tmp.mkdir(parents=True)
    with writing(final, cleanup=tmp):
        save_draft(tmp, draft, weights)
        for shard in sorted(shards.iterdir()) if shards is not None else ():
            os.replace(shard, tmp / shard.name)
        if optimizer_state is not None:
            torch.save(optimizer_state, tmp / "optimizer.pt")
        (tmp / "trainer_state.json").write_text(to_json(state, indent=2))
    old = root / f".step-{step:06d}.old-{os.getpid()}"
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    if shards is not None:
        shutil.rmtree(shards, ignore_errors=True)
    atomic_write_json(root / "latest.json", {"step": step})
    _prune(root, keep_last)
    return final


def shard_name(rank: int, world: int) -> str:
    """The file of a checkpoint holding one rank's slice of the optimizer state (FSDP2)."""
    return f"optimizer-rank{rank:05d}-of-{world:05d}.pt"


def stage_shards(root: Path, step: int) -> Path:
    """Where each rank writes its file of a checkpoint before rank 0 moves them in (rank 0 calls this, between
    barriers; a directory left by a killed save is removed first). Every rank must see `root`: a shared
    filesystem across nodes."""
    for stale in root.glob(".shards-*"):
        shutil.rmtree(stale, ignore_errors=True)
    staging = root / f".shards-{step:06d}"
    staging.mkdir(parents=True)
    return staging


def _prune(root: Path, keep_last: int) -> None:
    best = read_pointer(root / "best.json")
    steps = sorted(int(p.name[5:]) for p in root.glob("step-*") if p.is_dir())
    for step in steps[:-keep_last]:
        if best is None or step != best["step"]:
            shutil.rmtree(root / f"step-{step:06d}", ignore_errors=True)


def load_training_state(path: Path) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """Optimizer/scheduler/RNG state (None if the checkpoint has none) and the trainer's JSON state."""
    state = read_json_object(path / "trainer_state.json", "trainer state")
    optimizer_file = path / "optimizer.pt"
    if not optimizer_file.is_file():
        return None, state
    return load_torch_state(optimizer_file, "optimizer state"), state
