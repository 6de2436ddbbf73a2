"""Benchmark the offline hidden-state generator against plain forwards of the target, on identical batches.

    .venv/bin/python eval/bench_generate.py --records 96

Three phases, each in its own subprocess (so peak memory is per phase), over the first N train records
of the recipe's data (held-out emptied), split into shard-sized chunks and grouped by
`pipeline.padded_batches` with `generation.max_tokens_per_batch`, exactly as the generator does:

- raw_forward: `target.model(input_ids, attention_mask)`, the full HF CausalLM forward with logits;
- raw_body:    `target.model.get_decoder()(input_ids, attention_mask, use_cache=False)`, no lm_head;
- generator:   `generator.run_rank` end to end on a temporary output_dir (render, capture, copy to
  CPU in storage_dtype, background shard writes with fsync); target loading is not timed.

The raw phases run transformers' default kernels; the generator runs the target's linears packed for
oneDNN on CPU float32 (`target.cpu_packed_weights`; `--set target.cpu_packed_weights=false` compares the
same kernels). Raw phases time only the forwards (inputs are built and moved to the device beforehand).
Each phase runs one untimed warm-up batch first. Prints one JSON line on stdout and a table on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from speculators_train.data.chat import Chat
from speculators_train.data.conversations import SkipReport
from speculators_train.data.mix import Splits
from speculators_train.data.render import render_many
from speculators_train.data.splits import chunks, load_splits
from speculators_train.errors import run_script
from speculators_train.hidden_states import generator, pipeline
from speculators_train.layout import generation_progress
from speculators_train.recipe import DEFAULT_RECIPE, Recipe, load_recipe
from speculators_train.schema import parse_overrides
from speculators_train.target import Target, load_target

REPO = Path(__file__).resolve().parents[1]
Batch = tuple[torch.Tensor, torch.Tensor | None, int]  # input_ids, attention mask (None if unpadded), real tokens


def _setup(args: argparse.Namespace, extra: dict[str, Any] | None = None) -> tuple[Recipe, Splits, Target]:
    """Recipe with overrides, the first `--records` train records (no held-out), and the loaded target."""
    recipe = load_recipe(args.recipe, {**parse_overrides(args.set), **(extra or {})})
    splits = load_splits(recipe)
    splits = dataclasses.replace(splits, train=splits.train[: args.records], held_out=[])
    return recipe, splits, load_target(recipe.target)


def _forward_batches(recipe: Recipe, target: Target, splits: Splits) -> Iterator[Batch]:
    """The generator's forwards for rank 0 of 1: per shard-sized chunk, rendered, then padded like `capture`."""
    data = recipe.data
    for chunk in chunks(splits.train, recipe.generation.samples_per_shard):
        skips = SkipReport()
        chat = Chat(target.tokenizer, data.chat_template_kwargs)
        samples = [s for group in render_many(chunk, chat, data.max_length, data.overlong, skips) for s in group]
        max_tokens = recipe.generation.max_tokens_per_batch
        for _, lengths, ids, attention in pipeline.padded_batches(samples, max_tokens, target.device):
            yield ids, attention, sum(lengths)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _report(target: Target, seconds: float, samples: int, tokens: int) -> dict[str, Any]:
    """One phase's result, with this process's peak memory."""
    device = str(target.device)
    result = {
        "device": device,
        "torch_threads": torch.get_num_threads(),
        "seconds": seconds,
        "samples": samples,
        "tokens": tokens,
        "tok_s": tokens / seconds,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    if target.device.type == "cuda":
        result["device"] = f"{device} ({torch.cuda.get_device_name(target.device)})"
        result["cuda_peak_mib"] = torch.cuda.max_memory_allocated(target.device) / 2**20
    return result


def _raw_phase(args: argparse.Namespace, body: bool) -> dict[str, Any]:
    """Time plain forwards (full CausalLM, or decoder body only) over the prepared batches."""
    recipe, splits, target = _setup(args)
    batches = list(_forward_batches(recipe, target, splits))
    decoder = target.model.get_decoder()

    def forward(ids: torch.Tensor, mask: torch.Tensor | None) -> None:
        if body:
            decoder(input_ids=ids, attention_mask=mask, use_cache=False)
        else:
            target.model(input_ids=ids, attention_mask=mask)

    with torch.inference_mode():
        forward(*batches[0][:2])
        _sync(target.device)
        start = time.perf_counter()
        for ids, mask, _ in batches:
            forward(ids, mask)
        _sync(target.device)
        seconds = time.perf_counter() - start
    samples = sum(len(ids) for ids, _, _ in batches)
    return _report(target, seconds, samples, sum(n for _, _, n in batches))


def _generator_phase(args: argparse.Namespace) -> dict[str, Any]:
    """Time `run_rank` (what `generate` does per rank) with the target already loaded, on a temp dir."""
    with tempfile.TemporaryDirectory(prefix="bench_generate-") as tmp:
        recipe, splits, target = _setup(args, {"output_dir": tmp})
        identity = generator.generation_identity(recipe, target, splits, 1)
        progress = generator.Progress(generation_progress(recipe.hidden_states_dir, 0), identity)
        ids, mask, _ = next(_forward_batches(recipe, target, splits))
        target.hidden_states(ids, mask)
        _sync(target.device)
        start = time.perf_counter()
        generator.run_rank(recipe, target, splits, progress, rank=0, world=1, show=False)
        _sync(target.device)
        seconds = time.perf_counter() - start
        shards = progress.state["shards"]["train"]
        return _report(target, seconds, sum(e["num_samples"] for e in shards), sum(e["num_tokens"] for e in shards))


PHASES: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "raw_forward": lambda args: _raw_phase(args, body=False),
    "raw_body": lambda args: _raw_phase(args, body=True),
    "generator": _generator_phase,
}


def _run_child(args: argparse.Namespace, phase: str) -> dict[str, Any]:
    """Run one phase in a fresh interpreter; its last stdout line is its JSON result."""
    sets = [part for pair in args.set for part in ("--set", pair)]
    command = [sys.executable, __file__, "--recipe", args.recipe, "--records", str(args.records), *sets]
    done = subprocess.run([*command, "--phase", phase], stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _table(results: dict[str, dict[str, Any]]) -> Table:
    cuda = "cuda_peak_mib" in results["generator"]
    table = Table(title="hidden-state generation benchmark")
    for column in ("phase", "seconds", "tokens", "tok/s", "vs raw_forward", "peak RSS MiB"):
        table.add_column(column, justify="left" if column == "phase" else "right")
    if cuda:
        table.add_column("CUDA peak MiB", justify="right")
    base = results["raw_forward"]["tok_s"]
    for phase, r in results.items():
        row = [phase, f"{r['seconds']:.2f}", str(r["tokens"]), f"{r['tok_s']:.0f}", f"{r['tok_s'] / base:.2f}x"]
        row.append(f"{r['peak_rss_mib']:.0f}")
        if cuda:
            row.append(f"{r['cuda_peak_mib']:.0f}")
        table.add_row(*row)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(REPO / DEFAULT_RECIPE))
    parser.add_argument("--records", type=int, default=96, help="train records used (held-out is emptied)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe override")
    parser.add_argument("--phase", choices=list(PHASES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(PHASES[args.phase](args)))
        return
    recipe = load_recipe(args.recipe, parse_overrides(args.set))
    if recipe.data.regenerate.enabled:
        parser.error("data.regenerate.enabled: the raw phases cannot replay regeneration; set it to false")
    results = {phase: _run_child(args, phase) for phase in PHASES}
    counts = {phase: (r["samples"], r["tokens"]) for phase, r in results.items()}
    if len(set(counts.values())) != 1:
        raise SystemExit(f"phases saw different (samples, tokens): {counts}")
    raw_forward, raw_body, gen = (results[p]["tok_s"] for p in PHASES)
    summary = {
        "device": results["generator"]["device"],
        "torch_threads": results["generator"]["torch_threads"],
        "recipe": args.recipe,
        "records": args.records,
        "samples": results["generator"]["samples"],
        "tokens": results["generator"]["tokens"],
        "raw_forward_tok_s": raw_forward,
        "raw_body_tok_s": raw_body,
        "generator_tok_s": gen,
        "generator_vs_raw_forward": gen / raw_forward,
        "generator_vs_raw_body": gen / raw_body,
        "seconds": {phase: r["seconds"] for phase, r in results.items()},
        "peak_rss_mib": {phase: r["peak_rss_mib"] for phase, r in results.items()},
        "storage_dtype": recipe.generation.storage_dtype,
        "max_tokens_per_batch": recipe.generation.max_tokens_per_batch,
    }
    if "cuda_peak_mib" in results["generator"]:
        summary["cuda_peak_mib"] = {phase: r["cuda_peak_mib"] for phase, r in results.items()}
    print(json.dumps(summary), flush=True)
    Console(stderr=True).print(_table(results))


if __name__ == "__main__":
    run_script(main)
