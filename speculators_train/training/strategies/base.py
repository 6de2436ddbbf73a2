"""The strategy every other one extends, and DDP's (and one process's) as it stands: every rank holds the whole draft
and optimizer state; what a strategy gives a checkpoint (`Saved`); the tensor helpers the sharded ones share."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from speculators_train.errors import UserError
from speculators_train.recipe import Recipe

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class Saved:
    """What a strategy gives a checkpoint: the entries of `optimizer.pt` that restore its optimizer, the draft's
    whole tensors where a rank's own are shards, and a directory of per-rank files to move in."""

    optimizer: dict[str, Any]
    weights: dict[str, torch.Tensor] | None = None
    shards: Path | None = None


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t` (a DTensor's local shard; any other tensor is whole)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(t: torch.Tensor) -> int:
    t = getattr(local_tensor(t), "ds_tensor", local_tensor(t))  # ZeRO-3: the rank's partition
    return t.numel() * t.element_size()


class Strategy:
    """DDP, or one process: the whole draft and optimizer on every rank."""

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.cfg = recipe.training
        self.acc = None  # set by `engage`

    # Before the accelerator: its plugins; then a check of what accelerate made of them (`engage` keeps it).
    def plugins(self, cuda: bool) -> dict[str, Any]:
        return {}

    def engage(self, acc) -> None:
        """Refuse an accelerate launch for a strategy the recipe does not set: the recipe is where a run's strategy
        lives (its checkpoints and resume rules follow it); an accelerate config only places the ranks."""
        from accelerate.utils import DistributedType

        self.acc = acc
        if acc.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
            key = "fsdp" if acc.distributed_type == DistributedType.FSDP else "deepspeed"
            raise UserError(
                f"{self.recipe.source_path}: accelerate was launched for {acc.distributed_type.value} but the recipe "
                f"sets no training.{key}; set training.{key} in the recipe, or launch with a config of another "
                "distributed_type"
            )

    def check_held_out(self, total: int, fewest_on_a_rank: Callable[[], int]) -> None:
        """Refuse a run whose held-out split cannot be validated (every rank passes the same `total`)."""
        if total == 0:
            raise UserError(
                f"{self.recipe.source_path}: the held-out split has no samples, so nothing can be validated "
                "or kept as best; raise data.held_out_fraction"
            )

    def prepare(self, objective: nn.Module, optimizer: torch.optim.Optimizer):
        """The objective and optimizer wrapped for this strategy by the accelerator (kept for the methods below)."""
        self.model, self.optimizer = self.acc.prepare(objective, optimizer)
        return self.model, self.optimizer

    @property
    def draft(self) -> nn.Module:
        return self.acc.unwrap_model(self.model).draft

    def trainable(self) -> list[tuple[str, nn.Parameter]]:
        return [(name, p) for name, p in self.draft.named_parameters() if p.requires_grad]

    # Checkpoints: every rank calls `save` and `load` (some strategies gather or scatter in them).
    def save(self, ckpt_dir: Path, step: int) -> Saved:
        return Saved({"optimizer": self.optimizer.state_dict()})

    def load(self, path: Path, weights: dict[str, torch.Tensor], optimizer_state: dict[str, Any]) -> None:
        """A checkpoint's whole weights into the draft (names absent keep their values: the frozen tensors a family
        restores from the target) and its optimizer state into the optimizer."""
        self.draft.load_state_dict(weights, strict=False)
        self.optimizer.load_state_dict(optimizer_state["optimizer"])

    def memory_mib(self) -> dict[str, float]:
        """This rank's share of the training state after a step, in MiB: the objective's weights (trainable and
        frozen) and what the optimizer keeps."""
        return {
            "memory/weights_mib": sum(_nbytes(p) for p in self.model.parameters()) / 2**20,
            "memory/optimizer_mib": sum(_nbytes(t) for t in self._optimizer_tensors()) / 2**20,
        }

    def _inner_optimizer(self) -> torch.optim.Optimizer:
        return self.optimizer.optimizer

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        state = self._inner_optimizer().state
        return [t for one in state.values() for t in one.values() if torch.is_tensor(t) and t.dim() > 0]

    # Validation: which held-out batches this rank runs, and with the weights held how.
    def validation_batches(self, starts: list[int], most_on_a_rank: Callable[[int], int]) -> list[int]:
        """The batch starts this rank runs; those past `len(starts)` are collectives' padding, their metrics
        dropped."""
        return starts

    @contextlib.contextmanager
    def whole_for_validation(self) -> Iterator[None]:
        yield
