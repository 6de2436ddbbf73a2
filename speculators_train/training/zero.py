"""ZeRO optimizer state (and under ZeRO-3 the weights) as whole per-parameter tensors.

Under ZeRO each rank holds only a slice of the fp32 master weights and Adam moments (and under ZeRO-3 of the
module's weights too), so rank 0's own state is not a checkpoint. These collectives rebuild every parameter's full
tensors (all ranks must call them), so a DeepSpeed checkpoint is plain tensors loaded with `weights_only=True`
(DeepSpeed's own checkpoints are pickles) and resumes on the same world size exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

MOMENTS = ("exp_avg", "exp_avg_sq")


def gather(zero_optimizer, named_params: Iterable[tuple[str, torch.nn.Parameter]]) -> dict[str, Any]:
    """Full fp32 master weight and Adam moments per parameter name, plus the optimizer's step count."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    steps = {float(s["step"]) for s in zero_optimizer.optimizer.state.values()}
    params = {}
    for name, param in named_params:
        params[name] = {"fp32": safe_get_full_fp32_param(param).detach().cpu()}
        for key in MOMENTS:
            params[name][key] = safe_get_full_optimizer_state(param, key).detach().cpu()
    return {"step": max(steps, default=0.0), "params": params}


def stage3(zero_optimizer) -> bool:
    return hasattr(zero_optimizer, "fp32_partitioned_groups_flat")


def restore(zero_optimizer, named_params: Iterable[tuple[str, torch.nn.Parameter]], saved: dict[str, Any]) -> None:
    """Put `gather`'s output back into this rank's slices (before the first step the moments do not exist yet,
    so they are created at the saved step count first)."""
    from deepspeed.utils import (
        lazy_init_hp_params_optimizer_state,
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
    )

    def fresh(flat: torch.Tensor) -> dict[str, torch.Tensor]:
        step = torch.tensor(saved["step"], dtype=torch.float32)
        return {"step": step, **{key: torch.zeros_like(flat) for key in MOMENTS}}

    state = zero_optimizer.optimizer.state
    if stage3(zero_optimizer):  # the moments are keyed by the flat fp32 partitions; parameters find them by offset
        for flat in zero_optimizer.fp32_partitioned_groups_flat:
            state[flat] = fresh(flat)
    else:
        for params, flat in zip(
            zero_optimizer.bit16_groups, zero_optimizer.single_partition_of_fp32_groups, strict=True
        ):
            state[flat] = fresh(flat)
            lazy_init_hp_params_optimizer_state(params, flat, state)
    for name, param in named_params:
        tensors = saved["params"][name]
        safe_set_full_fp32_param(param, tensors["fp32"].to(param.device))
        for key in MOMENTS:
            safe_set_full_optimizer_state(param, tensors[key].to(param.device), key)


@contextlib.contextmanager
def whole(module: nn.Module, modify: bool = False) -> Iterator[None]:
    """Every parameter of `module` whole on every rank within the block (ZeRO-3 partitions them between forwards;
    a collective). With `modify`, what rank 0 holds at the end is partitioned back, so weights loaded inside the
    block (the same on every rank) become the weights trained."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=0 if modify else None):
        yield


def full_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's whole tensors under ZeRO-3, on the CPU (every rank takes part; rank 0 writes them)."""
    with whole(module):
        return {name: t.detach().cpu().clone() for name, t in module.state_dict().items()}
