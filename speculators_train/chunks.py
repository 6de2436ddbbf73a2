"""Computations over a vocabulary, made over chunks of positions so that their memory follows a set chunk, not the
sequence length times the vocabulary (the target's 128k-wide logits of a 4k-token sample are 2 GB in float32)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

# A loss over a vocabulary is computed over chunks of positions whose logits hold at most this many elements (64 MiB
# in float32): training's peak memory then follows the chunk, not the sequence length times the vocabulary.
CHUNK_ELEMENTS = 1 << 24


def chunk_rows(batch: int, vocab: int) -> int:
    """Positions per chunk for a [batch, positions, vocab] computation."""
    return max(1, CHUNK_ELEMENTS // max(batch * vocab, 1))


def chunked(fn: Callable[..., tuple[torch.Tensor, ...]], rows: int, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`fn` over chunks of `rows` positions (dim 1 of every tensor, all of one length), its outputs summed where they
    are 0-d (a loss sum) and concatenated along dim 1 otherwise (a per-position flag). Where autograd records, each
    chunk is checkpointed: the backward pass recomputes the chunk's logits from its inputs instead of keeping them."""
    length = tensors[0].shape[1]
    outs = []
    for start in range(0, max(length, 1), rows):  # an empty length runs `fn` once on empty slices: zero sums
        parts = [t[:, start : start + rows] for t in tensors]
        if torch.is_grad_enabled() and any(p.requires_grad for p in parts):
            outs.append(checkpoint(fn, *parts, use_reentrant=False))
        else:
            outs.append(fn(*parts))
    return tuple(
        torch.stack([o[k] for o in outs]).sum(0) if outs[0][k].dim() == 0 else torch.cat([o[k] for o in outs], dim=1)
        for k in range(len(outs[0]))
    )
