"""A run's budget and its learning rate over it: `training.epochs` and `max_steps` counted in optimizer steps, or
`training.max_minutes` of training time (validation and saves not counted), with a linear warmup over `warmup_ratio`
of it and a cosine decay to 0 at its end. The trainer and a resumed run read the same numbers from these."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from speculators_train.training.config import TrainingConfig


def total_steps(cfg: TrainingConfig, batches_per_epoch: int) -> int:
    """The optimizer steps of the step budget: one per `gradient_accumulation_steps` micro-batches."""
    total = cfg.epochs * math.ceil(batches_per_epoch / cfg.gradient_accumulation_steps)
    return min(total, cfg.max_steps) if cfg.max_steps else total


def lr_scheduler(
    opt: torch.optim.Optimizer, cfg: TrainingConfig, steps: int, train_seconds: Callable[[], float]
) -> torch.optim.lr_scheduler.LRScheduler:
    """Warmup and cosine over `steps`, or over the time budget when there is one (the step count is then unknown
    ahead, so the factor follows `train_seconds`, the run's training time so far)."""
    from torch.optim.lr_scheduler import LambdaLR
    from transformers import get_cosine_schedule_with_warmup

    if cfg.max_minutes:
        return LambdaLR(opt, lambda _step: time_lr_factor(cfg, train_seconds()))
    return get_cosine_schedule_with_warmup(opt, round(cfg.warmup_ratio * steps), steps)


def time_lr_factor(cfg: TrainingConfig, seconds: float) -> float:
    """Linear warmup over `warmup_ratio` of the time budget, then cosine to 0 at its end."""
    progress = min(1.0, seconds / (60 * cfg.max_minutes))
    warmup = cfg.warmup_ratio
    if progress < warmup:
        return progress / warmup
    return 0.5 * (1 + math.cos(math.pi * (progress - warmup) / (1 - warmup)))


def out_of_time(cfg: TrainingConfig, seconds: float) -> bool:
    return bool(cfg.max_minutes) and seconds >= 60 * cfg.max_minutes
