"""Where a training run starts: a fresh draft or the one `training.init_from` names, and, resuming, what it
must share with the run it continues, its checkpoint's state put back, and the metrics log cut back to that
checkpoint."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from speculators_train.architectures import text_config
from speculators_train.errors import UserError
from speculators_train.families.base import DraftStart, Family
from speculators_train.families.drafts import check_fits, load_draft, load_weights
from speculators_train.files import atomic_write_bytes
from speculators_train.loading import reading
from speculators_train.recipe import Recipe
from speculators_train.training import checkpoint as ckpt

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LRScheduler

    from speculators_train.training.strategies import Strategy

log = logging.getLogger(__name__)


def initial_draft(recipe: Recipe, family: Family, start: DraftStart):
    """A fresh draft of the recipe's family, or the draft named by `training.init_from` (in any format the family
    reads) to fine-tune, with its own vocab and settings."""
    if not recipe.training.init_from:
        return family.new_draft(recipe.draft, start)
    target_config, aux_layer_ids = start.target_config, start.aux_layer_ids
    path = recipe.resolve_path(recipe.training.init_from, "training.init_from", directory=True)
    text = text_config(target_config)
    loaded = load_draft(path, text.num_hidden_layers)
    if loaded.family is not family:
        raise UserError(
            f"{loaded.path}: a {loaded.family.name} draft, but the recipe trains draft.family {family.name}; "
            f"set draft.family: {loaded.family.name} to fine-tune it"
        )
    check_fits(loaded, text.hidden_size, text.vocab_size, text.num_hidden_layers)
    reads = list(family.states(loaded.draft.config).aux_layer_ids)
    if reads and reads != list(aux_layer_ids):
        raise UserError(
            f"{loaded.path}: this draft reads target layers {reads}, but the hidden states hold "
            f"{list(aux_layer_ids)}; set target.aux_layer_ids: {reads} and generate again"
        )
    # The target's embedding (frozen), as serving engines use it, even where the files carried one.
    family.attach_target(loaded.draft, start.head["embed"], False)
    log.info("fine-tuning %s (from its own files and vocabulary)", loaded.path)
    return loaded.draft


def resume_identity(recipe: Recipe, data_fingerprint: str, world: int) -> dict[str, Any]:
    """Settings a resumed run must share with the interrupted one (budgets like epochs may change)."""
    t = recipe.training
    identity = {
        "seed": recipe.seed,
        "draft": recipe.draft.model_dump(),
        "learning_rate": t.learning_rate,
        "batch_size": t.batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "weight_decay": t.weight_decay,
        "length_bucketing": t.length_bucketing,
        "world_size": world,
        "deepspeed": t.deepspeed.model_dump() if t.deepspeed else None,
        "fsdp": t.fsdp.model_dump() if t.fsdp else None,
        "hidden_states": recipe.generation.hidden_states,
        "samples_per_shard": recipe.generation.samples_per_shard,
        "data": recipe.data.model_dump(exclude={"mix"}),
        "data_fingerprint": data_fingerprint,
    }
    if t.init_from:
        identity["init_from"] = t.init_from
    if t.select:
        identity["select"] = t.select.model_dump()
    return identity


def with_defaults(identity: dict[str, Any], recipe: Recipe) -> dict[str, Any]:
    """A stored identity with settings added since it was written read as their defaults, so a new option never
    stops an old run from resuming."""
    identity = dict(identity)
    try:
        if isinstance(identity.get("draft"), dict):
            identity["draft"] = type(recipe.draft).model_validate(identity["draft"]).model_dump()
        if isinstance(identity.get("data"), dict):
            data = type(recipe.data).model_validate({**identity["data"], "mix": recipe.data.mix})
            identity["data"] = data.model_dump(exclude={"mix"})
    except ValueError:  # not a valid section at all: compared as stored, and named as a difference
        pass
    return identity


def check_same_run(path: Path, state: dict[str, Any], identity: dict[str, Any], recipe: Recipe) -> None:
    """Refuse to continue the checkpoint at `path` (its trainer `state`) under other settings."""
    stored = with_defaults(state.get("identity", {}), recipe)
    diffs = {k: (stored.get(k), v) for k, v in identity.items() if stored.get(k) != v}
    if diffs:
        detail = "; ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in diffs.items())
        raise UserError(f"{path} was trained with other settings ({detail}); use another output_dir")


def resume(
    path: Path, identity: dict[str, Any], recipe: Recipe, strategy: Strategy, scheduler: LRScheduler
) -> dict[str, Any]:
    """The trainer state of the checkpoint at `path`, with its weights, optimizer, schedule and RNG put back into
    `strategy` and `scheduler`; refused when it was trained under other settings (`identity`) or cannot continue
    exactly."""
    optimizer_state, state = ckpt.load_training_state(path)
    check_same_run(path, state, identity, recipe)
    if optimizer_state is None:
        raise UserError(
            f"{path} holds no optimizer state, so it cannot continue exactly; start a new output_dir, "
            "or delete its checkpoints to retrain"
        )
    weights = load_weights(path)
    with reading(path, "checkpoint does not fit this run"):  # a damaged or foreign state: one line, no trace
        strategy.load(path, weights, optimizer_state)
        scheduler.load_state_dict(optimizer_state["scheduler"])
        # The scheduler's state does not carry the learning rate it last set (the optimizer's state does, and
        # the ZeRO state above does not), so set it from the scheduler.
        for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr(), strict=True):
            group["lr"] = lr
        torch.set_rng_state(optimizer_state["torch_rng"])
    return state


def trim_log(path: Path, state: dict[str, Any]) -> None:
    """Drop the log lines the checkpoint this run continues from (its trainer `state`) does not cover,
    and a line cut by a kill, so a resumed run's log has each step and each validation once: what a killed run
    logged after its last checkpoint is redone and logged again. Training lines are covered up to the
    checkpoint's step, validation lines up to the step it last validated."""
    if not path.is_file():
        return
    covered = {"train": state["step"], "val": state.get("held_out_step", state["step"])}
    kept = []
    for line in path.read_text(errors="replace").splitlines(keepends=True):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not line.endswith("\n") or not isinstance(record, dict):
            continue
        kind = "val" if any(key.startswith("val/") for key in record) else "train"
        if record.get("step", 0) <= (covered[kind] or 0):
            kept.append(line)
    atomic_write_bytes(path, "".join(kept).encode())
