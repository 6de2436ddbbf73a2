"""One training step, shared by the trainer and online distillation: forward/loss, backward, clip, step.

The objective (any family's) returns the loss and its metric sums; nothing here knows which family it trains.
Clip and optimizer settings come from the recipe's `training` section, for both loops.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from speculators_train.distributed import deepspeed_process_state, lone_process_group
from speculators_train.errors import UserError
from speculators_train.families.objective import Sums
from speculators_train.recipe import Recipe
from speculators_train.training import fsdp

BETAS = (0.9, 0.95)  # the reference EAGLE/speculators trainers'; a shorter second-moment memory than torch's 0.999


def optimizer(params: list[nn.Parameter], learning_rate: float, weight_decay: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=learning_rate, weight_decay=weight_decay, betas=BETAS)


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def accelerator(recipe: Recipe, distributed: bool = True):
    """An `accelerate.Accelerator` for the recipe: CUDA unless the target is on CPU, `training.mixed_precision`;
    with `distributed`, the trainer's gradient accumulation and DeepSpeed or FSDP2 settings too (online distillation
    runs in one process and steps on every batch)."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DistributedType

    cfg = recipe.training
    cuda = torch.cuda.is_available() and recipe.target.device != "cpu"
    precision = ("bf16" if cuda else "no") if cfg.mixed_precision == "auto" else cfg.mixed_precision
    plugin = fsdp_plugin = None
    if distributed and cfg.deepspeed is not None:
        deepspeed_process_state(cuda)
        plugin = DeepSpeedPlugin(
            zero_stage=cfg.deepspeed.zero_stage,
            gradient_accumulation_steps=cfg.gradient_accumulation_steps,
            gradient_clipping=cfg.max_grad_norm,
            offload_optimizer_device="cpu" if cfg.deepspeed.offload_optimizer else "none",
        )
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = cfg.batch_size
        world = int(os.environ["WORLD_SIZE"])
        plugin.deepspeed_config["train_batch_size"] = cfg.batch_size * cfg.gradient_accumulation_steps * world
    elif distributed and cfg.fsdp is not None:
        lone_process_group(cuda)
        fsdp_plugin = fsdp.plugin(cfg.fsdp.reshard_after_forward, cfg.fsdp.cpu_offload and cuda)
    acc = Accelerator(
        cpu=not cuda and plugin is None,
        mixed_precision=precision,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps if distributed else 1,
        deepspeed_plugin=plugin,
        fsdp_plugin=fsdp_plugin,
    )
    if plugin is not None and acc.distributed_type != DistributedType.DEEPSPEED:
        raise UserError(
            f"{recipe.source_path}: training.deepspeed is set but accelerate did not engage DeepSpeed "
            f"(it runs as {acc.distributed_type}); check the accelerate config for a conflicting distributed_type"
        )
    if fsdp_plugin is not None:
        fsdp.engage(acc, fsdp_plugin)
    elif distributed and plugin is None and acc.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        # The recipe is where a run's strategy lives (its checkpoints and resume rules follow it); an accelerate
        # config only places the ranks.
        key = "fsdp" if acc.distributed_type == DistributedType.FSDP else "deepspeed"
        raise UserError(
            f"{recipe.source_path}: accelerate was launched for {acc.distributed_type.value} but the recipe sets no "
            f"training.{key}; set training.{key} in the recipe, or launch with a config of another distributed_type"
        )
    return acc


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
