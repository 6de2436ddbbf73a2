"""Where training batches come from: generator shards (offline) or the target run in the loop (online).

Both give the trainer the same thing: for an epoch, batches with a JSON-able position after each, so a
checkpoint records exactly where to continue (offline position: batch index; online: [chunk, batch]);
this rank's `held_out` samples; and what the draft is built from: `token_freq` (loss-masked train token
counts), `aux_layer_ids` and `data_fingerprint`.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from speculators_train.data.chat import Chat
from speculators_train.data.config import DataConfig, RegenerateConfig
from speculators_train.data.render import render_many
from speculators_train.data.splits import chunk_seed, chunks, data_fingerprint, load_splits
from speculators_train.errors import UserError
from speculators_train.families.base import STATE_LEVELS
from speculators_train.hidden_states.pipeline import process_chunk
from speculators_train.hidden_states.shards import HiddenStateShards, held_states, read_manifest, read_token_freq
from speculators_train.recipe import Recipe
from speculators_train.training.data import collate, epoch_batches

Batch = dict[str, torch.Tensor]
log = logging.getLogger(__name__)


class StoredBatches:
    """Shards written by `generate`; batches are global batches split across ranks (see epoch_batches).

    Like CapturedBatches, `held_out` holds this rank's share of the held-out samples."""

    def __init__(self, recipe: Recipe, world: int, rank: int) -> None:
        self.recipe, self.world, self.rank = recipe, world, rank
        directory = recipe.hidden_states_dir
        manifest = read_manifest(directory)
        if not manifest.get("complete"):
            raise UserError(f"{directory}: generation is not complete; rerun `speculators-train generate`")
        _check_manifest(recipe, manifest["identity"], directory)
        self.aux_layer_ids = manifest["identity"]["aux_layer_ids"]
        self.data_fingerprint = manifest["identity"]["data_fingerprint"]
        self.token_freq = read_token_freq(directory, manifest)
        # Only the states this family trains on are read (a final-state family skips the aux states of a fuller set).
        reads = recipe.draft.target_states
        self.train = HiddenStateShards(directory, "train", reads)
        self.kept = list(range(len(self.train)))  # the train samples epochs draw from (`restrict`)
        shards = HiddenStateShards(recipe.hidden_states_dir, "held_out", reads)
        # Every rank sees all shards; each validates its own share, read lazily from the shards.
        self.held_out = torch.utils.data.Subset(shards, range(rank, len(shards), world))

    def _batches(self, epoch: int) -> list[list[int]]:
        """A whole number of accumulation groups, so no gradient is left pending across epochs or checkpoints."""
        cfg = self.recipe.training
        lengths = [self.train.lengths[i] for i in self.kept]
        batches = epoch_batches(
            lengths, cfg.batch_size, self.recipe.seed, epoch, self.world, self.rank, cfg.length_bucketing
        )
        batches = [[self.kept[i] for i in batch] for batch in batches]
        usable = len(batches) - len(batches) % cfg.gradient_accumulation_steps
        if usable == 0:
            raise UserError(f"{len(batches)} batches per rank: fewer than gradient_accumulation_steps")
        return batches[:usable]

    def batches_per_epoch(self) -> int:
        return len(self._batches(0))

    def restrict(self, kept: list[int]) -> None:
        """Epochs draw from these train samples only (sorted indices into `train`)."""
        self.kept = sorted(kept)

    def epoch(self, epoch: int, position: Any) -> Iterator[tuple[Batch, Any]]:
        batches = self._batches(epoch)
        for index in range(position or 0, len(batches)):
            yield collate([self.train[i] for i in batches[index]]), index + 1


class CapturedBatches:
    """Records rendered and run through the target chunk by chunk, as `generate` would, kept in memory.

    A chunk's content is a pure function of (seed, epoch, rank, chunk), so a resumed run recomputes the
    chunk it stopped in and skips the batches already trained. Ranks agree on a common batch count per
    chunk (a collective), since ranks may lose different numbers of records to skips.
    """

    def __init__(self, recipe: Recipe, target, world: int, rank: int, min_across_ranks) -> None:
        self.recipe, self.target, self.world, self.rank = recipe, target, world, rank
        self.min_across_ranks = min_across_ranks
        splits = load_splits(recipe)
        if len(splits.train) < world:
            raise UserError(f"{len(splits.train)} training records cannot feed {world} ranks")
        if recipe.data.regenerate.enabled:
            log.warning("online + regenerate: the draft vocabulary is counted on the dataset's replies")
        self.token_freq = token_frequencies(recipe.data, splits, target)
        self.aux_layer_ids = target.aux_layer_ids
        self.data_fingerprint = data_fingerprint(splits)
        self.records = splits.train[rank::world]
        held = splits.held_out[rank::world]
        self.held_out = [
            s
            for k, chunk in enumerate(chunks(held, recipe.generation.samples_per_shard))
            for s in process_chunk(recipe, target, chunk, chunk_seed(recipe, "held_out", rank, k)).samples
        ]

        # Every rank walks the same number of chunks (a short rank gets empty ones), so the per-chunk
        # collective in `epoch` is called equally often everywhere.
        per_rank = math.ceil(len(splits.train) / world)
        self.num_chunks = math.ceil(per_rank / recipe.generation.samples_per_shard)

    def batches_per_epoch(self) -> int:
        """An upper estimate for the LR schedule (skipped records and trimming make epochs a little shorter),
        the same on every rank so all ranks build the same schedule."""
        return self.min_across_ranks(math.ceil(len(self.records) / self.recipe.training.batch_size))

    def epoch(self, epoch: int, position: Any) -> Iterator[tuple[Batch, Any]]:
        cfg = self.recipe.training
        records = list(self.records)
        random.Random(f"{self.recipe.seed}:{epoch}").shuffle(records)
        start_chunk, start_batch = position or (0, 0)
        size = self.recipe.generation.samples_per_shard
        for k in range(start_chunk, self.num_chunks):
            chunk = records[k * size : (k + 1) * size]
            seed = chunk_seed(self.recipe, f"train-epoch{epoch}", self.rank, k)
            samples = sorted(
                process_chunk(self.recipe, self.target, chunk, seed).samples, key=lambda s: len(s["input_ids"])
            )
            batches = [samples[i : i + cfg.batch_size] for i in range(0, len(samples), cfg.batch_size)]
            count = self.min_across_ranks(len(batches))
            count -= count % cfg.gradient_accumulation_steps
            for b in range(start_batch if k == start_chunk else 0, count):
                yield collate(batches[b]), (k, b + 1)


def _check_manifest(recipe: Recipe, identity: dict[str, Any], directory: Path) -> None:
    """Shards made for another target, layer set or data settings, or holding fewer states than this recipe's family
    trains on, must not train this recipe's draft."""
    wanted = recipe.target.aux_layer_ids
    reads, held = recipe.draft.target_states, held_states(identity)
    problems = []
    if identity["name_or_path"] != recipe.target.name_or_path:
        problems.append(f"target {identity['name_or_path']!r} there, {recipe.target.name_or_path!r} in the recipe")
    if STATE_LEVELS.index(held) < STATE_LEVELS.index(reads):
        problems.append(
            f"it holds {held!r} target states and a {recipe.draft.family} draft trains on {reads!r} "
            "(generate for this recipe into another output_dir)"
        )
    elif reads == "aux+final" and wanted is not None and identity["aux_layer_ids"] != wanted:
        problems.append(f"aux_layer_ids {identity['aux_layer_ids']} there, {wanted} in the recipe")
    data = recipe.data
    current = {
        "max_length": data.max_length,
        "overlong": data.overlong,
        "regenerate": RegenerateConfig.identity(data.regenerate.model_dump()),
    }
    stored = {**identity, "regenerate": RegenerateConfig.identity(identity.get("regenerate", {}))}
    problems += [
        f"data.{key} {stored.get(key)!r} there, {value!r} in the recipe"
        for key, value in current.items()
        if stored.get(key) != value
    ]
    if problems:
        raise UserError(f"{directory} was generated for another setup: " + "; ".join(problems))


def token_frequencies(data: DataConfig, splits, target) -> torch.Tensor:
    """Counts of loss-masked train tokens, as the generator's token_freq file holds (render only, no target).

    With data.regenerate on, these are the dataset's replies, not the target's (which do not exist yet)."""
    from speculators_train.data.conversations import SkipReport

    vocab_size = target.vocab_size
    freq = torch.zeros(vocab_size, dtype=torch.int64)
    for chunk in chunks(splits.train, 1024):
        chat = Chat.of(target, data.chat_template_kwargs, data.images)
        for group in render_many(chunk, chat, data.max_length, data.overlong, SkipReport()):
            for sample in group:
                freq += torch.bincount(sample.input_ids[sample.loss_mask], minlength=vocab_size)
    return freq
