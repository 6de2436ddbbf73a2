"""ZeRO-1/2 optimizer state as whole per-parameter tensors.

Under ZeRO each rank holds only a slice of the fp32 master weights and Adam moments, so rank 0's own state is not
a checkpoint. These collectives rebuild every parameter's full tensors (all ranks must call them), so a DeepSpeed
checkpoint is plain tensors loaded with `weights_only=True` (DeepSpeed's own checkpoints are pickles) and
resumes on the same world size exactly.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

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


def restore(zero_optimizer, named_params: Iterable[tuple[str, torch.nn.Parameter]], saved: dict[str, Any]) -> None:
    """Put `gather`'s output back into this rank's slices (before the first step the moments do not exist yet,
    so they are created at the saved step count first)."""
    from deepspeed.utils import (
        lazy_init_hp_params_optimizer_state,
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
    )

    state = zero_optimizer.optimizer.state
    for params, flat in zip(zero_optimizer.bit16_groups, zero_optimizer.single_partition_of_fp32_groups, strict=True):
        state[flat] = {
            "step": torch.tensor(saved["step"], dtype=torch.float32),
            **{key: torch.zeros_like(flat) for key in MOMENTS},
        }
        lazy_init_hp_params_optimizer_state(params, flat, state)
    for name, param in named_params:
        tensors = saved["params"][name]
        safe_set_full_fp32_param(param, tensors["fp32"].to(param.device))
        for key in MOMENTS:
            safe_set_full_optimizer_state(param, tensors[key].to(param.device), key)
