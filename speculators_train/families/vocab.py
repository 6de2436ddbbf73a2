"""Reduced draft vocabulary, shared by every family.

Keep the K target ids seen most often in loss-masked tokens, sorted ascending. The draft predicts
over those K ids; the maps stored with every draft are

    d2t[i] = kept[i] - i      int64 offsets, length K     target id = i + d2t[i]
    t2d[v] = v in kept        bool, length of the target vocab

Never stored in a float dtype: a float d2t silently maps to wrong ids past 2**24 (bf16: past 256).
"""

from __future__ import annotations

import torch


def build_vocab_mapping(token_freq: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-`draft_vocab_size` ids by frequency (ties: lower id first), padded with unseen low ids."""
    vocab = token_freq.numel()
    if not 0 < draft_vocab_size <= vocab:
        raise ValueError(f"draft_vocab_size {draft_vocab_size} must be in 1..{vocab} (the target vocab)")
    # Stable sort on -freq keeps ascending id order among equal counts, so unseen ids pad from the bottom.
    order = torch.sort(-token_freq.to(torch.int64), stable=True).indices
    kept = torch.sort(order[:draft_vocab_size]).values
    d2t = kept - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[kept] = True
    return d2t, t2d


def draft_to_target(d2t: torch.Tensor) -> torch.Tensor:
    """Target ids of the draft vocabulary, in draft order."""
    return torch.arange(d2t.numel(), device=d2t.device, dtype=torch.int64) + d2t
