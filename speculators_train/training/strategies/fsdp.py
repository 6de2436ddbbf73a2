"""FSDP2 through accelerate's plugin (`training.fsdp`): every parameter is a DTensor sharded along dim 0; the Adam
moments stay sharded, each rank writing its slice. accelerate engages FSDP only for GPU-like launches; on CPU (gloo)
and in one process this takes the same plugin path, so a GPU cluster runs the code the CPU tests run."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from speculators_train.distributed import lone_process_group
from speculators_train.layout import shard_name, shard_staging
from speculators_train.loading import load_torch_state
from speculators_train.training import checkpoint as ckpt
from speculators_train.training.strategies.base import MOMENTS, Saved, Strategy, local_tensor


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
        staging = shard_staging(ckpt_dir, step)
        state = self._inner_optimizer().state
        local = {}
        for name, param in self.trainable():
            if param not in state:  # before the first step
                continue
            local[name] = {"step": state[param]["step"].detach().cpu().clone()}
            local[name].update({key: local_tensor(state[param][key]).detach().cpu().clone() for key in MOMENTS})
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
                local = slices[name][key].to(local_tensor(param).device)
                if tuple(local.shape) != tuple(local_tensor(param).shape):
                    raise ValueError(
                        f"{name}: a {tuple(local.shape)} slice saved, a {tuple(local_tensor(param).shape)} shard here"
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
