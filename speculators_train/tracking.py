"""Experiment tracking: one wandb run per job, set by the recipe's `training.wandb` (offline by default)."""

from __future__ import annotations

from pathlib import Path

from speculators_train.errors import UserError
from speculators_train.recipe import Recipe


def init_wandb(recipe: Recipe, directory: Path, suffix: str = "", run_id: str | None = None):
    """A wandb run under `directory` (None when disabled), resumed if `run_id` already exists there."""
    cfg = recipe.training.wandb
    if cfg.mode == "disabled":
        return None
    import wandb

    directory.mkdir(parents=True, exist_ok=True)
    try:
        return wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=(cfg.run_name or recipe.name) + suffix,
            id=run_id,
            mode=cfg.mode,
            dir=str(directory),
            config=recipe.model_dump(mode="json"),
            resume="allow",
        )
    except wandb.errors.Error as exc:  # no API key, no network, a project the key cannot write
        raise UserError(
            f"training.wandb.mode {cfg.mode!r}: wandb refused the run: {exc} Log in (`wandb login` or "
            "WANDB_API_KEY), or set training.wandb.mode: offline (synced later with `wandb sync`)"
        ) from None
