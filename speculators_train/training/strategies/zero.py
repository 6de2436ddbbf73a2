"""DeepSpeed ZeRO stage 2 or 3 (`training.deepspeed`): each rank holds a slice of the fp32 master weights and Adam
moments (under stage 3 of the module's weights too); collectives rebuild each parameter's full tensors, saved as
plain tensors (DeepSpeed's own checkpoints are pickles)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from speculators_train.distributed import deepspeed_process_state
from speculators_train.errors import UserError
from speculators_train.training.strategies.base import MOMENTS, Saved, Strategy


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
