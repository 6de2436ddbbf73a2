"""Drafts on disk, for every family: this toolkit's checkpoints, the formats engines load, and fitting a target.

    <checkpoint>/model.safetensors     the draft's weights (not the frozen ones its family restores from the target)
    <checkpoint>/draft_config.json     {"family": NAME, ...the family's config}
    (a run's other names, and the pointers to its checkpoints: `layout.py`)

`load_draft` reads any directory a user points at: a checkpoint of ours (a checkpoints/ or run directory resolves
to its best), or a directory in one of the families' export formats, made here or by another tool (speculators,
SGLang, vLLM). Loading dispatches on the family the files name; nothing is unpickled, and nothing is built before
the config's values and the weights' names, shapes and dtypes are checked (`format_common.load_checked`), so a damaged
or hostile directory is one line naming the file and the key or tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from speculators_train import families
from speculators_train.errors import UserError
from speculators_train.families.base import Family, LoadedDraft
from speculators_train.families.format_common import load_checked, shown
from speculators_train.files import to_json
from speculators_train.layout import BEST, DRAFT_CONFIG, WEIGHTS, best_or_latest
from speculators_train.loading import load_tensors, read_json_object, reading

CONFIG, WEIGHTS = DRAFT_CONFIG, WEIGHTS


def family_of(draft: nn.Module) -> Family:
    for family in families.all_families():
        if type(draft) is family.draft_type:  # exact: one family's draft may extend another's
            return family
    raise TypeError(f"{type(draft).__name__} is not the draft of a registered family")


def draft_state_dict(draft: nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """What a checkpoint stores: every tensor but the frozen ones the family restores from the target (of `state`,
    the draft's whole tensors where its own are shards, or else of the draft itself)."""
    skip = family_of(draft).not_saved
    state = draft.state_dict() if state is None else state
    return {k: v.detach().cpu().contiguous() for k, v in state.items() if k not in skip}


def non_finite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The name of the first floating tensor holding NaN or +-inf, None when every value is a number."""
    return next((k for k, v in tensors.items() if v.is_floating_point() and not torch.isfinite(v).all()), None)


def refuse_non_finite(tensors: dict[str, torch.Tensor], where: str) -> None:
    """A draft with NaN or inf weights proposes garbage (or nothing) in every engine: never written, never used."""
    name = non_finite(tensors)
    if name is not None:
        raise UserError(f"{where}: tensor {name!r} holds non-finite values (NaN or inf); the draft is unusable")


def save_draft(directory: Path, draft: nn.Module, state: dict[str, torch.Tensor] | None = None) -> None:
    """Weights (of `state` where given: `draft_state_dict`) and config (with the family's name) into `directory`,
    which the caller renames into place."""
    weights = draft_state_dict(draft, state)
    refuse_non_finite(weights, f"saving the draft to {directory}")
    save_file(weights, directory / WEIGHTS)
    saved = {"family": family_of(draft).name, **draft.config.to_dict()}
    (directory / CONFIG).write_text(to_json(saved, indent=2))


def _family(saved: dict[str, Any], config_file: Path) -> Family:
    """The family a config names (the key is removed); configs saved before families were named are told apart by
    their fields."""
    if "family" not in saved:
        return families.get("medusa" if saved.pop("architecture", None) == "medusa" else "eagle3")
    name = saved.pop("family")
    if name not in families.FAMILIES:
        raise UserError(f"{config_file}: family {shown(name)} is not a draft family ({', '.join(families.FAMILIES)})")
    return families.get(name)


def load_checkpoint(path: Path) -> tuple[Family, nn.Module]:
    """A draft from one of our checkpoint directories (safetensors only), its config checked before anything is
    built and its weights against the module it describes (`format_common.load_checked`)."""
    config_file = path / CONFIG
    saved = read_json_object(config_file, "draft config")
    family = _family(saved, config_file)
    with reading(config_file, f"{family.name} draft config"):
        config = family.config_from_dict(saved)
    draft = load_checked(
        lambda: family.build(config), load_weights(path), path / WEIGHTS, config_file, optional=family.not_saved
    )
    return family, draft


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    return load_tensors(path / WEIGHTS, "draft weights")


def load_draft(path: Path, target_num_layers: int) -> LoadedDraft:
    """A draft from any directory: an export format of a family (by its config.json), else a checkpoint of ours.
    `target_num_layers` fills the default aux layer ids of a format that leaves them out."""
    if not path.exists():
        raise UserError(f"{path}: no such draft directory")
    config_file = path / "config.json"
    if config_file.is_file() and not (path / CONFIG).is_file():
        config = read_json_object(config_file, "draft config")
        for family in families.all_families():
            for export_format in family.formats.values():
                if export_format.detect(config):
                    draft, has_embedding = export_format.read(path, config, target_num_layers)
                    refuse_non_finite(draft.state_dict(), str(path))
                    return LoadedDraft(family, draft, path, has_embedding)
    resolved = resolve_checkpoint(path)
    family, draft = load_checkpoint(resolved)
    refuse_non_finite(draft.state_dict(), str(resolved))
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
        if mine and mine != theirs  # 0: the draft does not depend on it (reads no target state)
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


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint directory itself, or a checkpoints/ (or run) directory: its best, else its latest."""
    if (path / CONFIG).is_file():
        return path
    found = best_or_latest(path)
    if found is not None:
        return found
    raise UserError(f"{path}: no draft checkpoint there (expected {CONFIG}, or checkpoints with {BEST})")
