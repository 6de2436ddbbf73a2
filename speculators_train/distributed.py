"""Process-group state shared by every stage, so `accelerate launch` and `torchrun` behave alike."""

from __future__ import annotations

import os

import torch


def process_state():
    """accelerate's PartialState; CPU jobs (ACCELERATE_USE_CPU=1, or no CUDA) get a real gloo group.

    PartialState alone reads neither the flag nor a CPU-only machine as "multi-CPU": without `cpu=True`
    each torchrun rank would silently run as a lone rank 0 and the ranks would overwrite each other.
    """
    from accelerate import PartialState

    flag = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    return PartialState(cpu=flag or not torch.cuda.is_available())
