"""How a training run spreads the draft's objective over its processes: one `Strategy` per way, picked from the
recipe (`for_recipe`); the trainer calls the same methods whatever it is, so a new one (sequence or tensor
parallel) is one class here and one line in `for_recipe`. Every strategy writes the draft's whole weights to
`model.safetensors` (export, verify and `best` read one file whatever trained it), and optimizer state as plain
tensors loaded with `weights_only=True` that resume exactly on the same world size.

- `Strategy` itself is DDP (and one process): every rank holds the whole draft and optimizer state.
- `Zero` (DeepSpeed ZeRO 2 or 3): each rank holds a slice of the fp32 master weights and Adam moments (under stage
  3 of the module's weights too); collectives rebuild each parameter's full tensors (DeepSpeed's own checkpoints
  are pickles).
- `Fsdp` (FSDP2 through accelerate's plugin): every parameter is a DTensor sharded along dim 0; the Adam moments
  stay sharded, each rank writing its slice. accelerate engages FSDP only for GPU-like launches; on CPU (gloo) and
  in one process this takes the same plugin path, so a GPU cluster runs the code the CPU tests run.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from speculators_train.distributed import deepspeed_process_state, lone_process_group
from speculators_train.errors import UserError
from speculators_train.layout import shard_name
from speculators_train.loading import load_torch_state
from speculators_train.recipe import Recipe
from speculators_train.training import checkpoint as ckpt

MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class Saved:
    """What a strategy gives a checkpoint: the entries of `optimizer.pt` that restore its optimizer, the draft's
    whole tensors where a rank's own are shards, and a directory of per-rank files to move in."""

    optimizer: dict[str, Any]
    weights: dict[str, torch.Tensor] | None = None
    shards: Path | None = None


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(t: torch.Tensor) -> int:
    t = getattr(_local(t), "ds_tensor", _local(t))  # ZeRO-3: the rank's partition
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


class Zero(Strategy):
    """DeepSpeed ZeRO stage 2 or 3 (`training.deepspeed`)."""

    @property
    def stage3(self) -> bool:
        return self.cfg.deepspeed.zero_stage == 3

    def plugins(self, cuda: bool) -> dict[str, Any]:
        from accelerate.utils import DeepSpeedPlugin

        deepspeed_process_state(cuda)
        cfg = self.cfg
        plugin = DeepSpeedPlugin(
            zero_stage=cfg.deepspeed.zero_stage,
            gradient_accumulation_steps=cfg.gradient_accumulation_steps,
            gradient_clipping=cfg.max_grad_norm,
            offload_optimizer_device="cpu" if cfg.deepspeed.offload_optimizer else "none",
        )
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = cfg.batch_size
        world = int(os.environ["WORLD_SIZE"])
        plugin.deepspeed_config["train_batch_size"] = cfg.batch_size * cfg.gradient_accumulation_steps * world
        return {"deepspeed_plugin": plugin}

    def engage(self, acc) -> None:
        from accelerate.utils import DistributedType

        self.acc = acc
        if acc.distributed_type != DistributedType.DEEPSPEED:
            raise UserError(
                f"{self.recipe.source_path}: training.deepspeed is set but accelerate did not engage DeepSpeed "
                f"(it runs as {acc.distributed_type}); check the accelerate config for a conflicting distributed_type"
            )

    def check_held_out(self, total: int, fewest_on_a_rank: Callable[[], int]) -> None:
        super().check_held_out(total, fewest_on_a_rank)
        if self.stage3 and fewest_on_a_rank() == 0:
            # Each ZeRO-3 forward gathers weights from every rank, so every rank validates on batches of its own.
            raise UserError(
                f"{self.recipe.source_path}: training.deepspeed.zero_stage 3 needs a held-out sample on each of the "
                f"{self.acc.num_processes} ranks, and the held-out split has {total}; raise data.held_out_fraction"
            )

    def _zero_optimizer(self):
        return self.model.optimizer

    def save(self, ckpt_dir: Path, step: int) -> Saved:
        """Full fp32 master weight and Adam moments per parameter name, plus the optimizer's step count (and the
        whole weights under stage 3)."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        zero = self._zero_optimizer()
        steps = {float(s["step"]) for s in zero.optimizer.state.values()}
        params = {}
        for name, param in self.trainable():
            params[name] = {"fp32": safe_get_full_fp32_param(param).detach().cpu()}
            for key in MOMENTS:
                params[name][key] = safe_get_full_optimizer_state(param, key).detach().cpu()
        weights = None
        if self.stage3:
            with self._whole(self.draft):
                weights = {name: t.detach().cpu().clone() for name, t in self.draft.state_dict().items()}
        return Saved({"zero": {"step": max(steps, default=0.0), "params": params}}, weights)

    def load(self, path: Path, weights: dict[str, torch.Tensor], optimizer_state: dict[str, Any]) -> None:
        """`save`'s tensors back into this rank's slices (before the first step the moments do not exist yet, so
        they are created at the saved step count first)."""
        from deepspeed.utils import (
            lazy_init_hp_params_optimizer_state,
            safe_set_full_fp32_param,
            safe_set_full_optimizer_state,
        )

        with self._whole(self.draft, modify=self.stage3):
            self.draft.load_state_dict(weights, strict=False)
        saved = optimizer_state["zero"]

        def fresh(flat: torch.Tensor) -> dict[str, torch.Tensor]:
            step = torch.tensor(saved["step"], dtype=torch.float32)
            return {"step": step, **{key: torch.zeros_like(flat) for key in MOMENTS}}

        zero = self._zero_optimizer()
        state = zero.optimizer.state
        if hasattr(zero, "fp32_partitioned_groups_flat"):  # stage 3: moments keyed by the flat fp32 partitions
            for flat in zero.fp32_partitioned_groups_flat:
                state[flat] = fresh(flat)
        else:
            for params, flat in zip(zero.bit16_groups, zero.single_partition_of_fp32_groups, strict=True):
                state[flat] = fresh(flat)
                lazy_init_hp_params_optimizer_state(params, flat, state)
        for name, param in self.trainable():
            tensors = saved["params"][name]
            safe_set_full_fp32_param(param, tensors["fp32"].to(param.device))
            for key in MOMENTS:
                safe_set_full_optimizer_state(param, tensors[key].to(param.device), key)

    @contextlib.contextmanager
    def _whole(self, module: nn.Module, modify: bool = False) -> Iterator[None]:
        """Under stage 3, every parameter of `module` whole on every rank within the block (a collective). With
        `modify`, what rank 0 holds at the end is partitioned back, so weights loaded inside the block (the same
        on every rank) become the weights trained."""
        if not self.stage3:
            yield
            return
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0 if modify else None):
            yield

    def _inner_optimizer(self) -> torch.optim.Optimizer:
        return self._zero_optimizer().optimizer

    def _optimizer_tensors(self) -> list[torch.Tensor]:  # the moments, and the fp32 master partitions
        return super()._optimizer_tensors() + [p for g in self._inner_optimizer().param_groups for p in g["params"]]

    def validation_batches(self, starts: list[int], most_on_a_rank: Callable[[int], int]) -> list[int]:
        if not self.stage3:
            return starts
        # A ZeRO-3 forward is a collective: a rank with fewer batches repeats its last one.
        return starts + [starts[-1]] * (most_on_a_rank(len(starts)) - len(starts))


class Fsdp(Strategy):
    """FSDP2 (`training.fsdp`)."""

    def plugins(self, cuda: bool) -> dict[str, Any]:
        from accelerate.utils import FullyShardedDataParallelPlugin

        lone_process_group(cuda)
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            reshard_after_forward=self.cfg.fsdp.reshard_after_forward,
            cpu_offload=self.cfg.fsdp.cpu_offload and cuda,
            state_dict_type="SHARDED_STATE_DICT",
        )
        self._plugin = plugin
        return {"fsdp_plugin": plugin}

    def engage(self, acc) -> None:
        """Take accelerate's FSDP2 path where it did not pick it itself (CPU, or one process): the plugin's mixed
        precision set as accelerate sets it for its own FSDP launches."""
        from accelerate.utils import DistributedType

        self.acc = acc
        if acc.distributed_type == DistributedType.FSDP:
            return
        if acc.mixed_precision != "no":
            self._plugin.set_mixed_precision(acc.mixed_precision)
        acc.state.fsdp_plugin = self._plugin
        acc.state.distributed_type = DistributedType.FSDP

    def save(self, ckpt_dir: Path, step: int) -> Saved:
        """The whole weights (every rank takes part: each sharded parameter is all-gathered in the same order;
        rank 0 writes them), and each rank's slice of the Adam moments staged in one directory, all written before
        rank 0 moves them into the checkpoint."""
        from torch.distributed.tensor import DTensor

        weights = {}
        for name, value in self.draft.state_dict().items():
            full = value.full_tensor() if isinstance(value, DTensor) else value
            weights[name] = full.detach().cpu().contiguous()
        if self.acc.is_main_process:
            ckpt.stage_shards(ckpt_dir, step)
        self.acc.wait_for_everyone()
        staging = ckpt_dir / f".shards-{step:06d}"
        state = self._inner_optimizer().state
        local = {}
        for name, param in self.trainable():
            if param not in state:  # before the first step
                continue
            local[name] = {"step": state[param]["step"].detach().cpu().clone()}
            local[name].update({key: _local(state[param][key]).detach().cpu().clone() for key in MOMENTS})
        torch.save(local, staging / shard_name(self.acc.process_index, self.acc.num_processes))
        self.acc.wait_for_everyone()
        return Saved({}, weights, staging)

    def load(self, path: Path, weights: dict[str, torch.Tensor], optimizer_state: dict[str, Any]) -> None:
        """Whole tensors cut into this rank's shards (no communication), and this rank's saved slices put back as
        the moments of its shards (none were saved before the first step; after it, every trainable parameter has
        its slice)."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        with torch.no_grad():
            for name, value in self.draft.state_dict().items():
                if name not in weights:
                    continue
                saved = weights[name]
                if tuple(saved.shape) != tuple(value.shape):
                    raise ValueError(f"{name}: shape {tuple(saved.shape)} in the checkpoint, {tuple(value.shape)} here")
                if isinstance(value, DTensor):
                    piece = distribute_tensor(
                        saved.to(value.device, value.dtype), value.device_mesh, value.placements, src_data_rank=None
                    )
                    value.to_local().copy_(piece.to_local())
                else:
                    value.copy_(saved)
        shard = path / shard_name(self.acc.process_index, self.acc.num_processes)
        slices = load_torch_state(shard, "optimizer shard")
        for name, param in self.trainable() if slices else ():
            if name not in slices:
                raise KeyError(name)
            moments = {}
            for key in MOMENTS:
                local = slices[name][key].to(_local(param).device)
                if tuple(local.shape) != tuple(_local(param).shape):
                    raise ValueError(
                        f"{name}: a {tuple(local.shape)} slice saved, a {tuple(_local(param).shape)} shard here"
                    )
                if isinstance(param, DTensor):
                    local = DTensor.from_local(
                        local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
                    )
                moments[key] = local
            self._inner_optimizer().state[param] = {"step": slices[name]["step"].clone(), **moments}

    @contextlib.contextmanager
    def whole_for_validation(self) -> Iterator[None]:
        """Hold the whole parameters for the block: forwards then need no collective, so ranks with different
        numbers of held-out batches do not wait on each other."""
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(self.model, FSDPModule):
            yield
            return
        self.model.unshard()
        self.model.set_reshard_after_forward(False)
        try:
            yield
        finally:
            self.model.reshard()
            self.model.set_reshard_after_forward(self.cfg.fsdp.reshard_after_forward)


def for_recipe(recipe: Recipe) -> Strategy:
    """The recipe's strategy (the schema allows at most one of `training.deepspeed` and `training.fsdp`)."""
    if recipe.training.deepspeed is not None:
        return Zero(recipe)
    if recipe.training.fsdp is not None:
        return Fsdp(recipe)
    return Strategy(recipe)


def accelerator(recipe: Recipe, strategy: Strategy | None = None):
    """An `accelerate.Accelerator` for the recipe: CUDA unless the target is on CPU, `training.mixed_precision`;
    with the trainer's `strategy`, its plugins and gradient accumulation too (online distillation passes none: one
    process, a step on every batch)."""
    from accelerate import Accelerator

    cfg = recipe.training
    cuda = torch.cuda.is_available() and recipe.target.device != "cpu"
    precision = ("bf16" if cuda else "no") if cfg.mixed_precision == "auto" else cfg.mixed_precision
    plugins = strategy.plugins(cuda) if strategy is not None else {}
    acc = Accelerator(
        cpu=not cuda and "deepspeed_plugin" not in plugins,
        mixed_precision=precision,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps if strategy is not None else 1,
        **plugins,
    )
    if strategy is not None:
        strategy.engage(acc)
    return acc
