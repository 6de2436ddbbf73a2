"""Reduced draft vocabulary, shared by every family.

Keep the K target ids seen most often in loss-masked tokens, sorted ascending. The draft predicts
over those K ids; the maps stored with every draft are

    d2t[i] = kept[i] - i      int64 offsets, length K     target id = i + d2t[i]
    t2d[v] = v in kept        bool, length of the target vocab

Never stored in a float dtype: a float d2t silently maps to wrong ids past 2**24 (bf16: past 256). A draft read
from disk is held to the same rules (`checked_maps`): otherwise a bad offset surfaces as an IndexError mid-decode.
"""

from __future__ import annotations

from typing import Any

import torch


def default_mask_token_id(target_config: Any) -> int:
    """The input id of a parallel drafter's mask slots when the recipe names none (P-EAGLE, DFlash): speculators'
    fallback when the tokenizer has no mask token and no spare embedding row: pad, eos, else 0."""
    text = target_config.get_text_config()
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(text, name, None)
        value = value[0] if isinstance(value, list) and value else value
        if isinstance(value, int) and 0 <= value < text.vocab_size:
            return value
    return 0


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


def first_ids(draft_vocab_size: int, target_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of the lowest `draft_vocab_size` target ids: what a draft holds until its vocabulary is copied
    in, so even an untrained draft's maps agree with each other."""
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[:draft_vocab_size] = True
    return torch.zeros(draft_vocab_size, dtype=torch.int64), t2d


def draft_to_target(d2t: torch.Tensor) -> torch.Tensor:
    """Target ids of the draft vocabulary, in draft order."""
    return torch.arange(d2t.numel(), device=d2t.device, dtype=torch.int64) + d2t


def kind(tensor: torch.Tensor) -> str:
    """What a stored tensor holds, as far as a draft cares: float, integer, bool or complex."""
    if tensor.dtype == torch.bool:
        return "bool"
    if tensor.is_floating_point():
        return "float"
    return "complex" if tensor.is_complex() else "integer"


def ids_problem(ids: torch.Tensor, name: str, draft_vocab_size: int, target_vocab_size: int) -> str | None:
    """Why `ids` (the target id of each draft id, read from the file's `name`) are not a draft vocabulary, or None.

    One integer per draft id, each in the target vocabulary, strictly increasing: that is how every writer builds
    them (`build_vocab_mapping`, SpecForge), and readers rely on it: Medusa's objective maps a target id back to
    its draft id by counting t2d (a cumulative sum), which holds only for distinct ascending ids."""
    if kind(ids) != "integer":
        return f"{name} is {str(ids.dtype).removeprefix('torch.')}; the vocabulary maps are integer ids, never float"
    if tuple(ids.shape) != (draft_vocab_size,):
        return f"{name} has shape {list(ids.shape)}, expected [{draft_vocab_size}] (one per draft id)"
    ids = ids.to(torch.int64)
    outside = ((ids < 0) | (ids >= target_vocab_size)).nonzero()
    if outside.numel():
        i = int(outside[0, 0])
        last = target_vocab_size - 1
        return f"{name} maps draft id {i} to target id {int(ids[i])}, outside the target vocabulary 0..{last}"
    falling = (ids[1:] <= ids[:-1]).nonzero()
    if falling.numel():
        i = int(falling[0, 0])
        return (
            f"{name} maps draft ids {i} and {i + 1} to target ids {int(ids[i])} and {int(ids[i + 1])}; "
            "target ids must increase strictly (each once, ascending)"
        )
    return None


def checked_maps(
    d2t: torch.Tensor | None, t2d: torch.Tensor | None, draft_vocab_size: int, target_vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A file's d2t and t2d as int64 and bool, once they are one draft vocabulary (ValueError saying why not).
    A file without t2d (it is optional in the export formats) gets the one its d2t implies."""
    if d2t is None:
        raise ValueError(f"d2t is missing (a {draft_vocab_size}-id draft vocabulary of {target_vocab_size} target ids)")
    if kind(d2t) != "integer" or tuple(d2t.shape) != (draft_vocab_size,):  # checked as d2t, before adding offsets
        raise ValueError(ids_problem(d2t, "d2t", draft_vocab_size, target_vocab_size))
    d2t = d2t.to(torch.int64)
    problem = ids_problem(draft_to_target(d2t), "d2t", draft_vocab_size, target_vocab_size)
    if problem:
        raise ValueError(problem)
    implied = torch.zeros(target_vocab_size, dtype=torch.bool)
    implied[draft_to_target(d2t)] = True
    if t2d is None:
        return d2t, implied
    if t2d.dtype != torch.bool:
        raise ValueError(f"t2d is {str(t2d.dtype).removeprefix('torch.')}, expected bool (never float)")
    if tuple(t2d.shape) != (target_vocab_size,):
        raise ValueError(f"t2d has shape {list(t2d.shape)}, expected [{target_vocab_size}] (one per target id)")
    differ = (t2d != implied).nonzero()
    if differ.numel():
        v = int(differ[0, 0])
        kept = bool(t2d[v])
        says = "keeps" if kept else "drops"
        raise ValueError(f"t2d {says} target id {v}, but d2t maps {'no' if kept else 'a'} draft id to it")
    return d2t, t2d
