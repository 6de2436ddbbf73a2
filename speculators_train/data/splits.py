"""The recipe's data as work: its splits, their fingerprint, and the deterministic chunks every stage cuts them into.

A chunk's content and seed are pure functions of (recipe seed, split, rank, index), so offline shards, online
training and resumed runs all see the same records in the same chunks.
"""

from __future__ import annotations

import hashlib
import json

from speculators_train.data.config import DataConfig
from speculators_train.data.conversations import Conversation
from speculators_train.data.mix import Splits, load_mix
from speculators_train.recipe import Recipe

SPLITS = ("train", "held_out")


def load_splits(recipe: Recipe) -> Splits:
    mix_path = recipe.resolve_path(recipe.data.mix, "data.mix")
    return load_mix(mix_path, recipe.data.held_out_fraction)


def no_held_out(recipe: Recipe, splits: Splits) -> str | None:
    """Why training would refuse these splits (an empty held-out split, which it validates on and keeps the best
    checkpoint by), said at `data` and refused at `generate` rather than first at `train`; None when it would not."""
    if splits.held_out:
        return None
    return (
        f"{recipe.source_path}: data.held_out_fraction {recipe.data.held_out_fraction:g} holds out none of the "
        f"{len(splits.train)} records, and training validates on that split; raise it or add records"
    )


def rendered_counts(
    data: DataConfig, splits: Splits, tokenizer, processor=None, no_images: str = ""
) -> dict[str, dict[str, int]]:
    """Per split: records, samples, tokens and loss tokens, rendered with the target's chat template (and a
    multimodal target's processor) as `generate` renders them (the dataset's replies: regeneration would replace
    them); skips go into `splits.report`."""
    from speculators_train.data.chat import Chat
    from speculators_train.data.render import render_many

    chat = Chat(tokenizer, data.chat_template_kwargs, processor, no_images, data.images)
    out = {}
    for split in SPLITS:
        records = getattr(splits, split)
        counts = {"records": len(records), "samples": 0, "tokens": 0, "loss_tokens": 0}
        for chunk in chunks(records, 256):
            for group in render_many(chunk, chat, data.max_length, data.overlong, splits.report):
                counts["samples"] += len(group)
                counts["tokens"] += sum(len(s.input_ids) for s in group)
                counts["loss_tokens"] += sum(int(s.loss_mask.sum()) for s in group)
        out[split] = counts
    return out


def data_fingerprint(splits: Splits) -> str:
    digest = hashlib.sha256()
    for split in SPLITS:
        for conv in getattr(splits, split):
            digest.update(json.dumps([split, conv.id, conv.messages]).encode())
    return digest.hexdigest()[:16]


def chunks(records: list[Conversation], size: int) -> list[list[Conversation]]:
    return [records[k : k + size] for k in range(0, len(records), size)]


def chunk_seed(recipe: Recipe, split: str, rank: int, index: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{recipe.seed}:{split}:{rank}:{index}".encode()).digest()[:4], "big")
