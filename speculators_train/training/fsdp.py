"""FSDP2 (`torch.distributed.fsdp.fully_shard`, through accelerate's FSDP plugin) for the draft's objective.

accelerate engages FSDP only for GPU-like launches; on CPU (gloo) and in a single process it runs the same plugin
path once the process group exists and the state says FSDP (`engage`), so the code a GPU cluster runs is the code
the CPU tests run.

Under FSDP2 every parameter is a DTensor sharded along dim 0 across the ranks, so neither a rank's parameters nor
its optimizer state are a checkpoint by themselves:
- the draft's weights are gathered whole (`full_weights`, a collective) into `model.safetensors`, as every other
  strategy writes them, so export, verify and `best` read one file whatever trained it;
- the Adam moments stay sharded: each rank writes its own slice (`local_optimizer_state`) as plain tensors, loaded
  with `weights_only=True`, and a resumed run on the same world size puts each slice back (`restore_optimizer_state`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

MOMENTS = ("exp_avg", "exp_avg_sq")


def shard_name(rank: int, world: int) -> str:
    return f"optimizer-rank{rank:05d}-of-{world:05d}.pt"


def plugin(reshard_after_forward: bool, cpu_offload: bool):
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(
        fsdp_version=2,
        reshard_after_forward=reshard_after_forward,
        cpu_offload=cpu_offload,
        state_dict_type="SHARDED_STATE_DICT",
    )


def engage(acc, fsdp_plugin) -> None:
    """Make a prepared-to-be accelerator take accelerate's FSDP2 path where it did not pick it itself (CPU, or one
    process): the plugin's mixed precision is set as accelerate sets it for its own FSDP launches."""
    from accelerate.utils import DistributedType

    if acc.distributed_type == DistributedType.FSDP:
        return
    if acc.mixed_precision != "no":
        fsdp_plugin.set_mixed_precision(acc.mixed_precision)
    acc.state.fsdp_plugin = fsdp_plugin
    acc.state.distributed_type = DistributedType.FSDP


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def full_weights(draft: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the draft's state dict, whole, on the CPU (all ranks must call: each sharded parameter is
    all-gathered in the same order)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, value in draft.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        out[name] = full.detach().cpu().contiguous()
    return out


def load_full_weights(draft: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy whole tensors (a checkpoint's) into this rank's shards; names not in `weights` keep their values (the
    frozen tensors a family restores from the target). No communication: each rank cuts its own slice."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, value in draft.state_dict().items():
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


def local_optimizer_state(optimizer: torch.optim.Optimizer, named: list[tuple[str, nn.Parameter]]) -> dict[str, Any]:
    """This rank's slice of each parameter's Adam moments and step count, as plain tensors."""
    state = optimizer.state
    out = {}
    for name, param in named:
        if param not in state:  # before the first step
            continue
        saved = state[param]
        out[name] = {"step": saved["step"].detach().cpu().clone()}
        out[name].update({key: _local(saved[key]).detach().cpu().clone() for key in MOMENTS})
    return out


def restore_optimizer_state(
    optimizer: torch.optim.Optimizer, named: list[tuple[str, nn.Parameter]], saved: dict[str, Any]
) -> None:
    """Put `local_optimizer_state`'s slices back as the moments of this rank's shards (none were saved before the
    first step; after it, every trainable parameter has its slice)."""
    from torch.distributed.tensor import DTensor

    if not saved:
        return
    for name, param in named:
        if name not in saved:
            raise KeyError(name)
        tensors = saved[name]
        moments = {}
        for key in MOMENTS:
            local = tensors[key].to(_local(param).device)
            if tuple(local.shape) != tuple(_local(param).shape):
                raise ValueError(
                    f"{name}: a {tuple(local.shape)} slice saved, a {tuple(_local(param).shape)} shard here"
                )
            if isinstance(param, DTensor):
                local = DTensor.from_local(
                    local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
                )
            moments[key] = local
        optimizer.state[param] = {"step": tensors["step"].clone(), **moments}


@contextmanager
def gathered(model: nn.Module, reshard_after_forward: bool):
    """Hold the whole parameters for the block (validation): forwards then need no collective, so ranks with
    different numbers of held-out batches do not wait on each other."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        yield
        return
    model.unshard()
    model.set_reshard_after_forward(False)
    try:
        yield
    finally:
        model.reshard()
        model.set_reshard_after_forward(reshard_after_forward)
