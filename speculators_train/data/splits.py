"""The recipe's data as work: its splits, their fingerprint, and the deterministic chunks every stage cuts them into.

A chunk's content and seed are pure functions of (recipe seed, split, rank, index), so offline shards, online
training and resumed runs all see the same records in the same chunks.
"""

from __future__ import annotations

import hashlib
import json

from speculators_train.data.conversations import Conversation
from speculators_train.data.mix import Splits, load_mix
from speculators_train.recipe import Recipe

SPLITS = ("train", "held_out")


def load_splits(recipe: Recipe) -> Splits:
    mix_path = recipe.resolve_path(recipe.data.mix, "data.mix")
    return load_mix(mix_path, recipe.data.held_out_fraction)


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
