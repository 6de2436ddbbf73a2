"""Process-group state shared by every stage, so `accelerate launch` and `torchrun` behave alike."""

from __future__ import annotations

import os
import socket

import torch


def _cpu_flag() -> bool:
    return os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")


def process_state():
    """accelerate's PartialState; CPU jobs (ACCELERATE_USE_CPU=1, or no CUDA) get a real gloo group.

    PartialState alone reads neither the flag nor a CPU-only machine as "multi-CPU": without `cpu=True`
    each torchrun rank would silently run as a lone rank 0 and the ranks would overwrite each other.
    """
    from accelerate import PartialState

    return PartialState(cpu=_cpu_flag() or not torch.cuda.is_available())


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on, for a one-process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lone_process_group(cuda: bool) -> None:
    """A one-rank group where no launcher made one (FSDP's collectives need one even on one rank): nccl for CUDA
    tensors, gloo for CPU ones. Under torchrun or accelerate launch the group is accelerate's."""
    import torch.distributed as dist

    if dist.is_initialized() or "LOCAL_RANK" in os.environ:
        return
    if cuda:
        torch.cuda.set_device(0)
    init = f"tcp://127.0.0.1:{free_port()}"
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=0, world_size=1)


def deepspeed_process_state(cuda: bool):
    """PartialState for a DeepSpeed run, before the Accelerator is built: nccl on CUDA, gloo on CPU.

    accelerate skips DeepSpeed whenever it runs "on CPU", and on a CPU-only machine it picks no backend, so every
    torchrun rank would count itself rank 0 of 1. Naming gloo keeps the real group, and DeepSpeed's CPU
    accelerator then runs ZeRO over it. A plain single process gets the one-rank environment `accelerate launch`
    would give it, because DeepSpeed only starts from a launcher's environment.
    """
    from accelerate import PartialState

    if "LOCAL_RANK" not in os.environ:
        defaults = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
        os.environ.update({**defaults, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    os.environ.pop("ACCELERATE_USE_CPU", None)  # the recipe asked for DeepSpeed; the CPU flag would switch it off
    return PartialState(cpu=False, **({} if cuda else {"backend": "gloo"}))


def across_ranks(acc, value: float, op: str) -> float:
    """The largest (`op` "max") or smallest ("min") `value` of any rank, of `value`'s type; every rank must call.
    Ranks' clocks and data shares differ: a budget or a count must stop or pad them all alike."""
    if acc.num_processes == 1:
        return value
    import torch.distributed as dist

    tensor = torch.tensor(value, device=acc.device, dtype=torch.float64 if isinstance(value, float) else torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN)
    return type(value)(tensor)
