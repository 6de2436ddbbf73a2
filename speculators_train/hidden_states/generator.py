"""Run the target over the data and keep its hidden states: offline (resumable shards) or online (in memory).

Work is split deterministically: rank r of W takes records r, r+W, r+2W, ... of each split, and its
k-th shard holds its records [k*S, (k+1)*S). A shard is listed in the rank's progress file only after
it is fully on disk, so a killed run resumes at the first unlisted shard: nothing lost, nothing twice.
"""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save
from tqdm import tqdm

from speculators_train.data.config import ImagesConfig, RegenerateConfig
from speculators_train.data.conversations import SkipReport
from speculators_train.data.mix import Splits
from speculators_train.data.regenerate import replying_engine
from speculators_train.data.splits import SPLITS, chunk_seed, chunks, data_fingerprint, load_splits, no_held_out
from speculators_train.distributed import process_state
from speculators_train.errors import UserError
from speculators_train.families.base import STATE_LEVELS
from speculators_train.files import atomic_write_bytes, atomic_write_json, remove_stale_temporaries, sha256_bytes
from speculators_train.hidden_states.pipeline import ChunkResult, process_chunk, replying_model_dir
from speculators_train.hidden_states.shards import (
    FORMAT,
    VERSION,
    check_sha256,
    held_states,
    read_manifest,
    shard_name,
    write_shard,
)
from speculators_train.layout import MANIFEST, RUN_INFO, TOKEN_FREQ, generation_progress
from speculators_train.loading import open_tensors, read_json
from speculators_train.origin import target_fingerprint
from speculators_train.recipe import Recipe
from speculators_train.runinfo import write_run_info
from speculators_train.target import Target, load_target

log = logging.getLogger(__name__)


def generation_identity(recipe: Recipe, target: Target, splits: Splits, world_size: int) -> dict[str, Any]:
    """Everything that must match for a rerun to continue the same output instead of mixing two. The engine is
    named only when it is not transformers, so sets made before there was a choice still resume."""
    engine = {"capture_engine": "vllm"} if recipe.generation.engine == "vllm" else {}
    kwargs = recipe.data.chat_template_kwargs
    return {
        **target.identity(),
        "aux_layer_ids": target.aux_layer_ids,
        "final_state": "pre_norm",
        "target_states": recipe.draft.target_states,
        "storage_dtype": recipe.generation.storage_dtype,
        "max_length": recipe.data.max_length,
        "overlong": recipe.data.overlong,
        "regenerate": RegenerateConfig.identity(recipe.data.regenerate.model_dump()),
        "data_fingerprint": data_fingerprint(splits),
        "samples_per_shard": recipe.generation.samples_per_shard,
        "world_size": world_size,
        **engine,
        **({"chat_template_kwargs": kwargs} if kwargs else {}),  # named only when set: older sets still resume
        # which image references are read decides which records are stored; named only when not the default
        **({"images": images.model_dump()} if (images := recipe.data.images) != ImagesConfig() else {}),
    }


def check_identity(path: Path, stored: dict[str, Any], current: dict[str, Any]) -> None:
    stored = {**stored, "target_states": held_states(stored)}
    if "regenerate" in stored:
        stored = {**stored, "regenerate": RegenerateConfig.identity(stored["regenerate"])}
    diffs = [
        f"{key}: {stored.get(key)!r} there, {current.get(key)!r} now"
        for key in sorted(set(stored) | set(current))
        if stored.get(key) != current.get(key)
    ]
    if diffs:
        raise UserError(
            f"{path} holds hidden states made with different settings; refusing to mix them:\n  "
            + "\n  ".join(diffs)
            + "\nUse another output_dir, or delete that directory to start over."
        )


class Progress:
    """One rank's record of finished shards, rewritten atomically after each shard lands on disk."""

    def __init__(self, path: Path, identity: dict[str, Any]) -> None:
        self.path = path
        if path.is_file():
            state = read_json(path, "generation progress")
            check_identity(path, state.get("identity", {}), identity)
            self.state = state
        else:
            # Written at once, so a rank with no records still leaves a file for rank 0 to merge.
            self.state = {"identity": identity, "shards": {s: [] for s in SPLITS}}
            atomic_write_json(path, self.state)

    def done(self, split: str) -> int:
        return len(self.state["shards"][split])

    def add(self, split: str, entry: dict[str, Any]) -> None:
        self.state["shards"][split].append(entry)
        atomic_write_json(self.path, self.state)


def generate(recipe: Recipe) -> dict[str, Any]:
    """Offline generation for this process's rank; rank 0 writes the manifest once every rank is done."""
    if recipe.generation.hidden_states == "online":
        raise UserError(
            f"{recipe.source_path}: generation.hidden_states is 'online': states are captured in memory during "
            "`train`, nothing is written; set it to 'offline' to write shards"
        )
    state = process_state()
    rank, world = state.process_index, state.num_processes
    out_dir = recipe.hidden_states_dir
    splits = load_splits(recipe)
    if why := no_held_out(recipe, splits):
        raise UserError(why)
    # With vLLM capturing, this process needs the target's config and tokenizer, not its weights.
    target = load_target(recipe.target, weights=recipe.generation.engine != "vllm")
    identity = generation_identity(recipe, target, splits, world)
    if (out_dir / MANIFEST).is_file():
        manifest = read_manifest(out_dir)
        held = held_states(manifest["identity"])
        if manifest.get("complete") and STATE_LEVELS.index(held) > STATE_LEVELS.index(identity["target_states"]):
            # A complete set holding more states than this family reads serves it as it is (train reads a subset).
            identity = {**identity, "target_states": held}
        check_identity(out_dir / MANIFEST, manifest["identity"], identity)
        if manifest.get("complete"):
            log.info("%s is already complete; nothing to do", out_dir)
            return manifest
    if state.is_main_process:
        write_run_info(out_dir / RUN_INFO, recipe.model_dump(mode="json"))
        removed = remove_stale_temporaries(out_dir)
        if removed:
            log.info("removed %d partial files left by an interrupted run", removed)
    state.wait_for_everyone()
    progress = Progress(generation_progress(out_dir, rank), identity)
    run_rank(recipe, target, splits, progress, rank, world, state.is_local_main_process, state.local_process_index)
    state.wait_for_everyone()
    manifest = (
        _finalize(out_dir, identity, splits, world, target_fingerprint(recipe.target)) if state.is_main_process else {}
    )
    state.wait_for_everyone()
    return manifest


def run_rank(
    recipe: Recipe,
    target: Target,
    splits: Splits,
    progress: Progress,
    rank: int,
    world: int,
    show: bool,
    local_rank: int = 0,
) -> None:
    size = recipe.generation.samples_per_shard
    work = {split: chunks(getattr(splits, split)[rank::world], size) for split in SPLITS}
    total = sum(len(c) for parts in work.values() for c in parts)
    done = sum(len(c) for split, parts in work.items() for c in parts[: progress.done(split)])
    bar = tqdm(total=total, initial=done, unit="rec", desc=f"generate[rank {rank}]", disable=not show)
    tokens, start = 0, time.perf_counter()
    # A vLLM engine starts only where this rank has shards left to write, once for all of them.
    engine = replying = None
    left = any(progress.done(s) < len(p) for s, p in work.items())
    if recipe.generation.engine == "vllm" and left:
        from speculators_train.hidden_states.vllm_capture import VllmCapture

        engine = VllmCapture(recipe, target, rank, local_rank)
    regen = recipe.data.regenerate
    if regen.enabled and regen.engine == "vllm" and left:
        replying = replying_engine(replying_model_dir(recipe), recipe.data.max_length, recipe.seed)
    # One background writer: serialising + hashing + fsync of shard k overlaps the forward of shard k+1.
    with (
        engine or contextlib.nullcontext(),
        replying or contextlib.nullcontext(),
        ThreadPoolExecutor(max_workers=1) as writer,
    ):
        pending: Future | None = None
        for split, parts in work.items():
            folder = recipe.hidden_states_dir / split
            for k in range(progress.done(split), len(parts)):
                seed = chunk_seed(recipe, split, rank, k)
                result = process_chunk(recipe, target, parts[k], seed, engine=engine, replying=replying)
                if pending is not None:
                    pending.result()
                pending = writer.submit(_store, progress, split, folder / shard_name(rank, k), result)
                tokens += sum(len(s["input_ids"]) for s in result.samples)
                bar.update(len(parts[k]))
                bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.0f}")
        if pending is not None:
            pending.result()
    bar.close()


def _store(progress: Progress, split: str, path: Path, result: ChunkResult) -> None:
    if result.samples:
        entry = write_shard(path, result.samples)
    else:
        entry = {"file": None, "num_samples": 0, "num_tokens": 0, "num_loss_tokens": 0}
    entry["skips"] = result.skips.to_dict()
    progress.add(split, entry)


def _finalize(
    out_dir: Path, identity: dict[str, Any], splits: Splits, world: int, fingerprint: dict[str, Any]
) -> dict[str, Any]:
    """Merge the ranks' progress into manifest.json and count loss-masked token frequencies. `fingerprint`: the
    target's revision and config hash, beside the identity (a set made before it was recorded still resumes)."""
    skips = SkipReport()
    skips.merge(splits.report)
    manifest_splits = {}
    freq = torch.zeros(identity["vocab_size"], dtype=torch.int64)
    for split in SPLITS:
        shards = []
        for rank in range(world):
            state = read_json(generation_progress(out_dir, rank), "generation progress")
            for entry in state["shards"][split]:
                skips.merge(SkipReport.from_dict(entry.pop("skips")))
                shards.append(entry)
                if split == "train" and entry["num_samples"]:
                    path = out_dir / split / entry["file"]
                    check_sha256(path, entry["sha256"])
                    with open_tensors(path, "hidden-state shard") as fh:
                        ids, mask = fh.get_tensor("input_ids"), fh.get_tensor("loss_mask")
                    freq += torch.bincount(ids[mask], minlength=len(freq))
        records = len(getattr(splits, split))
        if records and not sum(e["num_samples"] for e in shards):  # train would fail later, for a reason given here
            raise UserError(skips.nothing_left(str(out_dir), split, records))
        manifest_splits[split] = {
            "records": records,
            "samples": sum(e["num_samples"] for e in shards),
            "tokens": sum(e["num_tokens"] for e in shards),
            "loss_tokens": sum(e["num_loss_tokens"] for e in shards),
            "shards": shards,
        }
    freq_bytes = save({"token_freq": freq})
    atomic_write_bytes(out_dir / TOKEN_FREQ, freq_bytes)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "complete": True,
        "identity": identity,
        "target_config": fingerprint,
        "splits": manifest_splits,
        "skips": skips.to_dict(),
        "token_freq": TOKEN_FREQ,
        "token_freq_sha256": sha256_bytes(freq_bytes),
    }
    atomic_write_json(out_dir / MANIFEST, manifest)
    return manifest
