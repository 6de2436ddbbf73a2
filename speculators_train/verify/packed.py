"""Linear weights packed for a fixed row count, for the CPU verify loop.

A verify pass feeds K+1 tokens (a tree: budget+1) through the target at once. On CPU, MKL's default sgemm for
4 to a few dozen rows runs at about half the speed of a single row, so a 6-token verify pass cost twice a
1-token decode step, and speculation lost most of what acceptance gained. On weights packed for exactly that
row count (`mkl._mkl_reorder_linear_weight`, what inductor's freezing pass uses on CPU), 6 rows cost about as
much as 1. Other row counts (prefill, the last short steps) keep the default kernel, so results are the same
GEMM up to float rounding order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn


def available(model: nn.Module) -> bool:
    """Packing applies to float32 models on CPU with a torch built with MKL."""
    parameter = next(model.parameters())
    return (
        parameter.device.type == "cpu"
        and parameter.dtype == torch.float32
        and torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_linear")
    )


def _packed_forward(module: nn.Linear, rows: Iterable[int]):
    weight, bias = module.weight.detach(), None if module.bias is None else module.bias.detach()
    packed = {n: torch.ops.mkl._mkl_reorder_linear_weight(weight, n) for n in sorted(set(rows))}

    def forward(x: torch.Tensor) -> torch.Tensor:
        n = x.shape[:-1].numel()
        if n not in packed or torch.is_grad_enabled():
            return F.linear(x, module.weight, module.bias)
        out = torch.ops.mkl._mkl_linear(x.reshape(n, x.shape[-1]), packed[n], weight, bias, n)
        return out.view(*x.shape[:-1], out.shape[-1])

    return forward


@contextlib.contextmanager
def packed_linears(model: nn.Module, rows: Iterable[int]) -> Iterator[bool]:
    """Within the block, every `nn.Linear` of `model` runs inputs of `rows` rows on packed weights (no-grad
    only; the weights must not change meanwhile). Yields whether packing applies; outside CPU float32 with MKL
    the model is left as it is. Memory: one extra copy of the linear weights per row count."""
    rows = list(rows)
    if not rows or not available(model):
        yield False
        return
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    try:
        for module in linears:
            module.forward = _packed_forward(module, rows)
        yield True
    finally:
        for module in linears:
            module.__dict__.pop("forward", None)
