"""Drafts on disk, for every family: this toolkit's checkpoints, the layouts engines load, and fitting a target.

    <checkpoint>/model.safetensors     the draft's weights (not the frozen ones its family restores from the target)
    <checkpoint>/draft_config.json     {"family": NAME, ...the family's config}
    checkpoints/latest.json, best.json pointers to step-NNNNNN/ directories (written by the trainer)

`load_draft` reads any directory a user points at: a checkpoint of ours (a checkpoints/ or run directory resolves
to its best), or a directory in one of the families' export layouts, made here or by another tool (speculators,
SGLang, vLLM). Loading dispatches on the family the files name; nothing is unpickled.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from speculators_train import families
from speculators_train.errors import UserError
from speculators_train.families.base import Family, LoadedDraft
from speculators_train.files import read_json

CONFIG = "draft_config.json"
WEIGHTS = "model.safetensors"


def family_of(draft: nn.Module) -> Family:
    for family in families.all_families():
        if isinstance(draft, family.draft_type):
            return family
    raise TypeError(f"{type(draft).__name__} is not the draft of a registered family")


def draft_state_dict(draft: nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint stores: every tensor but the frozen ones the family restores from the target."""
    skip = family_of(draft).not_saved
    return {k: v.detach().cpu().contiguous() for k, v in draft.state_dict().items() if k not in skip}


def save_draft(directory: Path, draft: nn.Module) -> None:
    """Weights and config (with the family's name) into `directory`, which the caller renames into place."""
    save_file(draft_state_dict(draft), directory / WEIGHTS)
    saved = {"family": family_of(draft).name, **draft.config.to_dict()}
    (directory / CONFIG).write_text(json.dumps(saved, indent=2))


def _family_name(saved: dict[str, Any]) -> str:
    """The family a config names; configs saved before families were named are told apart by their fields."""
    if "family" in saved:
        return str(saved.pop("family"))
    return "medusa" if saved.pop("architecture", None) == "medusa" else "eagle3"


def load_checkpoint(path: Path) -> tuple[Family, nn.Module]:
    """A draft from one of our checkpoint directories (safetensors only)."""
    saved = read_json(path / CONFIG, "draft config")
    if not isinstance(saved, dict):
        raise UserError(f"{path / CONFIG}: not a draft config of this toolkit")
    family = families.get(_family_name(saved))
    try:
        config = family.config_from_dict(saved)
    except (TypeError, ValueError) as exc:
        raise UserError(f"{path / CONFIG}: not a {family.name} draft config of this toolkit ({exc})") from None
    draft = family.build(config)
    missing, unexpected = draft.load_state_dict(load_weights(path), strict=False)
    missing = [k for k in missing if k not in family.not_saved]
    if missing or unexpected:
        raise UserError(f"{path}: weights do not fit the draft (missing {missing}, unexpected {unexpected})")
    return family, draft


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(path / WEIGHTS)
    except OSError as exc:
        raise UserError(f"{path / WEIGHTS}: unreadable checkpoint weights ({exc})") from None


def load_draft(path: Path, target_num_layers: int) -> LoadedDraft:
    """A draft from any directory: an export layout of a family (by its config.json), else a checkpoint of ours.
    `target_num_layers` fills the default aux layer ids of a layout that leaves them out."""
    if not path.exists():
        raise UserError(f"{path}: no such draft directory")
    config_file = path / "config.json"
    if config_file.is_file() and not (path / CONFIG).is_file():
        config = read_json(config_file, "draft config")
        for family in families.all_families():
            for layout in family.layouts.values():
                if isinstance(config, dict) and layout.detect(config):
                    draft, has_embedding = layout.read(path, config, target_num_layers)
                    return LoadedDraft(family, draft, path, has_embedding)
    resolved = resolve_checkpoint(path)
    family, draft = load_checkpoint(resolved)
    return LoadedDraft(family, draft, resolved, False)  # ours never store the target's embedding


def fit_problems(loaded: LoadedDraft, hidden_size: int, vocab_size: int, num_layers: int) -> list[str]:
    """Every way a draft's shapes disagree with a target's, each naming what differs."""
    config = loaded.draft.config
    problems = [
        f"{name}: draft {mine}, target {theirs}"
        for name, mine, theirs in (
            ("hidden size", config.target_hidden_size, hidden_size),
            ("vocab size", config.target_vocab_size, vocab_size),
        )
        if mine != theirs
    ]
    if config.target_num_layers and config.target_num_layers != num_layers:
        problems.append(f"layer count: draft trained on {config.target_num_layers}, target has {num_layers}")
    ids = list(loaded.family.states(config).aux_layer_ids)
    if ids and max(ids) >= num_layers:
        problems.append(f"aux layer ids {ids} need < {num_layers} target layers")
    return problems


def check_fits(loaded: LoadedDraft, hidden_size: int, vocab_size: int, num_layers: int) -> None:
    problems = fit_problems(loaded, hidden_size, vocab_size, num_layers)
    if problems:
        raise UserError(f"{loaded.path}: draft does not fit the target ({'; '.join(problems)})")


def read_pointer(path: Path) -> dict[str, Any] | None:
    return read_json(path, "checkpoint pointer") if path.is_file() else None


def is_complete(path: Path) -> bool:
    return all((path / name).is_file() for name in (WEIGHTS, CONFIG, "trainer_state.json"))


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint `latest.json` names; if that one is gone or incomplete, the newest complete one."""
    pointer = read_pointer(root / "latest.json")
    if pointer is not None:
        path = root / f"step-{int(pointer['step']):06d}"
        if is_complete(path):
            return path
    complete = sorted((p for p in root.glob("step-*") if is_complete(p)), key=lambda p: p.name)
    return complete[-1] if complete else None


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint directory itself, or a checkpoints/ (or run) directory: its best, else its latest."""
    if (path / CONFIG).is_file():
        return path
    for root in (path, path / "checkpoints", path / "train" / "checkpoints"):
        pointer = read_pointer(root / "best.json") if (root / "best.json").is_file() else None
        if pointer is not None and (root / f"step-{int(pointer['step']):06d}").is_dir():
            return root / f"step-{int(pointer['step']):06d}"
        latest = latest_checkpoint(root) if root.is_dir() else None
        if latest is not None:
            return latest
    raise UserError(f"{path}: no draft checkpoint there (expected {CONFIG}, or checkpoints with best.json)")
