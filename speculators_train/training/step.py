"""One training step, shared by the trainer and online distillation: forward/loss, backward, clip, step.

The objective (any family's) returns the loss and its metric sums; nothing here knows which family it trains.
Clip and optimizer settings come from the recipe's `training` section, for both loops.
"""

from __future__ import annotations

import torch
from torch import nn

from speculators_train.families.objective import Sums

BETAS = (0.9, 0.95)  # the reference EAGLE/speculators trainers'; a shorter second-moment memory than torch's 0.999


def optimizer(params: list[nn.Parameter], learning_rate: float, weight_decay: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=learning_rate, weight_decay=weight_decay, betas=BETAS)


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def train_step(
    acc, model: nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor], max_grad_norm: float
) -> tuple[torch.Tensor, Sums]:
    """Forward + loss, backward; clip and step once per accumulated group (`acc.sync_gradients`)."""
    with acc.accumulate(model), acc.autocast():
        loss, metrics = model(batch)
        acc.backward(loss)
        if acc.sync_gradients:
            acc.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad()
    return loss.detach(), metrics
