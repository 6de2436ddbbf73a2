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
from speculators_train.files import atomic_write_json
from speculators_train.models.eagle3 import Eagle3Config, Eagle3Draft

# The target's embedding is frozen and large; it is restored from the target, not stored per checkpoint.
NOT_SAVED = ("embed_tokens.weight",)


def draft_state_dict(draft: Eagle3Draft) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in draft.state_dict().items() if k not in NOT_SAVED}


def save_checkpoint(
    root: Path, step: int, draft: Eagle3Draft, optimizer_state: dict[str, Any], state: dict[str, Any], keep_last: int
) -> Path:
    """Write into a temporary directory, then rename: a kill leaves the previous checkpoint intact."""
    final = root / f"step-{step:06d}"
    tmp = root / f".step-{step:06d}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(draft_state_dict(draft), tmp / "model.safetensors")
    (tmp / "draft_config.json").write_text(json.dumps(draft.config.to_dict(), indent=2))
    torch.save(optimizer_state, tmp / "optimizer.pt")
    (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
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
    return json.loads(path.read_text()) if path.is_file() else None


def latest_checkpoint(root: Path) -> Path | None:
    pointer = read_pointer(root / "latest.json")
    if pointer is None:
        return None
    path = root / f"step-{pointer['step']:06d}"
    if not path.is_dir():
        raise UserError(f"{root / 'latest.json'} names {path.name}, which is missing; delete latest.json to restart")
    return path


def load_draft(path: Path, embed_weight: torch.Tensor | None = None) -> Eagle3Draft:
    """Rebuild a draft from a checkpoint directory (safetensors only: nothing is unpickled)."""
    try:
        config = Eagle3Config(**json.loads((path / "draft_config.json").read_text()))
        weights = load_file(path / "model.safetensors")
    except (OSError, json.JSONDecodeError, TypeError) as exc:
        raise UserError(f"{path}: not a readable draft checkpoint ({exc})") from None
    draft = Eagle3Draft(config)
    missing, unexpected = draft.load_state_dict(weights, strict=False)
    missing = [k for k in missing if k not in NOT_SAVED]
    if missing or unexpected:
        raise UserError(f"{path}: weights do not fit the draft (missing {missing}, unexpected {unexpected})")
    if embed_weight is not None:
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(embed_weight)
    return draft


def load_training_state(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    optimizer_state = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    return optimizer_state, json.loads((path / "trainer_state.json").read_text())
