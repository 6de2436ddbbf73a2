"""How a training run spreads the draft's objective over its processes: one `Strategy` per way, a module each,
picked from the recipe (`for_recipe`); the trainer calls the same methods whatever it is, so a new one (sequence or
tensor parallel) is one module here and one line in `for_recipe`. Every strategy writes the draft's whole weights to
`model.safetensors` (export, verify and `best` read one file whatever trained it), and optimizer state as plain
tensors loaded with `weights_only=True` that resume exactly on the same world size.

- `base.py`: `Strategy` itself, which is DDP (and one process): every rank holds the whole draft and optimizer state.
- `zero.py`: `Zero`, DeepSpeed ZeRO 2 or 3: each rank holds a slice of the optimizer state (and, under stage 3, of
  the weights).
- `fsdp.py`: `Fsdp`, FSDP2 through accelerate's plugin: every parameter a DTensor sharded along dim 0.
"""

from __future__ import annotations

import torch

from speculators_train.recipe import Recipe
from speculators_train.training.strategies.base import Strategy
from speculators_train.training.strategies.fsdp import Fsdp
from speculators_train.training.strategies.zero import Zero


def for_recipe(recipe: Recipe) -> Strategy:
    """The recipe's strategy (the schema allows at most one of `training.deepspeed` and `training.fsdp`)."""
    if recipe.training.deepspeed is not None:
        return Zero(recipe)
    if recipe.training.fsdp is not None:
        return Fsdp(recipe)
    return Strategy(recipe)


def accelerator(recipe: Recipe, strategy: Strategy | None = None):
    """An `accelerate.Accelerator` for the recipe: CUDA unless the target is on CPU, `training.mixed_precision`;
    with the trainer's `strategy`, its plugins and gradient accumulation too (online distillation passes none: one
    process, a step on every batch)."""
    from accelerate import Accelerator

    cfg = recipe.training
    cuda = torch.cuda.is_available() and recipe.target.device != "cpu"
    precision = ("bf16" if cuda else "no") if cfg.mixed_precision == "auto" else cfg.mixed_precision
    plugins = strategy.plugins(cuda) if strategy is not None else {}
    acc = Accelerator(
        cpu=not cuda and "deepspeed_plugin" not in plugins,
        mixed_precision=precision,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps if strategy is not None else 1,
        **plugins,
    )
    if strategy is not None:
        strategy.engage(acc)
    return acc
