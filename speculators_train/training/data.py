"""Batches for training: deterministic per (seed, epoch), split across ranks, padded on the right.

The batch order is a pure function of (seed, epoch, world size), so a resumed run replays exactly the
batches the interrupted one would have seen, starting at the recorded batch index.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch

from speculators_train.errors import UserError

STATE_KEYS = ("input_ids", "loss_mask", "aux_hidden_states", "hidden_state")


def epoch_batches(
    lengths: Sequence[int], batch_size: int, seed: int, epoch: int, world: int, rank: int, bucketing: bool
) -> list[list[int]]:
    """This rank's batches (sample indices) for one epoch.

    Global batches of `batch_size * world` samples are cut from one seeded order, then rank r takes
    slice r of each: W ranks with batch b see exactly the samples of 1 rank with batch W*b.
    """
    rng = random.Random(f"{seed}:{epoch}")
    order = list(range(len(lengths)))
    rng.shuffle(order)
    global_size = batch_size * world
    if bucketing:
        # Sort within windows of 32 global batches: similar lengths share a batch, order stays random.
        window = 32 * global_size
        windows = [sorted(order[k : k + window], key=lengths.__getitem__) for k in range(0, len(order), window)]
        order = [i for w in windows for i in w]
    batches = [order[k : k + global_size] for k in range(0, len(order) - global_size + 1, global_size)]
    if not batches:
        raise UserError(f"{len(lengths)} samples cannot fill one global batch of {global_size} ({world} ranks)")
    rng.shuffle(batches)
    return [batch[rank * batch_size : (rank + 1) * batch_size] for batch in batches]


def collate(samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample; padded positions have loss_mask False and never reach a loss. Samples
    captured for a draft that reads no aux states have none."""
    longest = max(len(s["input_ids"]) for s in samples)
    out: dict[str, torch.Tensor] = {}
    for key in (k for k in STATE_KEYS if k in samples[0]):
        first = samples[0][key]
        padded = torch.zeros((len(samples), longest, *first.shape[1:]), dtype=first.dtype)
        for row, sample in enumerate(samples):
            padded[row, : len(sample[key])] = sample[key]
        out[key] = padded
    out["lengths"] = torch.tensor([len(s["input_ids"]) for s in samples])
    return out
