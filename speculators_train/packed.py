"""Linear weights prepacked for oneDNN: the target's (and in verify the draft's) CPU float32 kernels.

Decoding runs a linear over very few rows: 1 per target-only step, K+1 per verify pass (a tree: budget+1), one
per frontier node in the draft. On the default kernels (MKL) a few rows cost much more than one, so a verify
pass cost well over a plain step and speculation lost most of what acceptance gained; with the weights
reordered once for oneDNN (`mkldnn._reorder_linear_weight`, what inductor's CPU freezing pass does) a few rows
cost about what one does. The target-only baseline and the speculative runs use the same packed weights, so
speedups compare the same kernels; hidden-state capture runs faster packed too (figures: RESULTS.md). The
outputs are the same linear maps up to float32 rounding order. `target.cpu_packed_weights` turns it on or off
for every stage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn


def available(model: nn.Module) -> bool:
    """Packing applies to float32 models on CPU with a torch built with oneDNN (mkldnn)."""
    parameter = next(model.parameters())
    return (
        parameter.device.type == "cpu"
        and parameter.dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def _packed_forward(module: nn.Linear, rows: int):
    weight, bias = module.weight.detach(), None if module.bias is None else module.bias.detach()
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)

    def forward(x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or x.numel() == 0:
            return F.linear(x, module.weight, module.bias)
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1])

    return forward


@contextlib.contextmanager
def packed_linears(models: list[nn.Module], rows: int) -> Iterator[bool]:
    """Within the block, every `nn.Linear` of these models runs on oneDNN-packed weights (no-grad only; the
    weights must not change meanwhile). `rows` is the typical row count the packing is tuned for; any count
    works. Yields whether packing applies (float32 on CPU with oneDNN; other models are left as they are).
    Memory: one extra copy of the linear weights. A linear that already has its own `forward` (packed by an
    enclosing block, or hooked by accelerate) is left alone, so nested blocks and hooks survive the exit; so is a
    subclass that overrides `forward` (a residual block built on a Linear), whose map is more than its weights."""
    models = [m for m in models if available(m)]
    linears = list(
        dict.fromkeys(
            m
            for model in models
            for m in model.modules()
            if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward and "forward" not in m.__dict__
        )
    )
    try:
        for module in linears:
            module.forward = _packed_forward(module, rows)
        yield bool(models)
    finally:
        for module in linears:
            module.__dict__.pop("forward", None)
