"""Hidden-state capture throughput: vLLM's extract_hidden_states (`generation.engine: vllm`) against transformers.

    .venv/bin/python eval/bench_capture.py --records 64

Each engine runs in its own subprocess over the same first N train records of the recipe's data, split into
shard-sized chunks as `generate` splits them. A phase loads the target (transformers: the model; vllm: the config
and tokenizer, then starts the engine, timed apart as `start_s`), captures the first chunk untimed, then times
`generator.process_chunk` (render + capture, the states on CPU in the storage dtype) over every chunk. Shard
writes are left out: they are the same code for both. Peak memory is this process's peak RSS plus, for vLLM, the
engine processes' RSS at the end. Prints one JSON line on stdout and a table on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.table import Table

from speculators_train.data.splits import chunks, load_splits
from speculators_train.errors import run_script
from speculators_train.hidden_states import generator
from speculators_train.recipe import DEFAULT_RECIPE, load_recipe
from speculators_train.schema import parse_overrides
from speculators_train.target import load_target

REPO = Path(__file__).resolve().parents[1]
ENGINES = ("transformers", "vllm")


def _phase(args: argparse.Namespace, engine_name: str, tmp: str) -> dict[str, Any]:
    overrides = {**parse_overrides(args.set), "generation.engine": engine_name, "output_dir": tmp}
    recipe = load_recipe(args.recipe, overrides)
    splits = load_splits(recipe)
    parts = chunks(splits.train[: args.records], recipe.generation.samples_per_shard)
    target = load_target(recipe.target, weights=engine_name == "transformers")
    start = time.perf_counter()
    engine = None
    if engine_name == "vllm":
        from speculators_train.hidden_states.vllm_capture import VllmCapture

        engine = VllmCapture(recipe, target, rank=0, local_rank=0)
    with engine or contextlib.nullcontext():
        start_s = time.perf_counter() - start
        generator.process_chunk(recipe, target, parts[0], 0, engine=engine)  # warm-up
        tokens = samples = 0
        start = time.perf_counter()
        for k, part in enumerate(parts):
            result = generator.process_chunk(recipe, target, part, k, engine=engine)
            samples += len(result.samples)
            tokens += sum(len(s["input_ids"]) for s in result.samples)
        seconds = time.perf_counter() - start
        engine_rss = sum(p.memory_info().rss for p in psutil.Process().children(recursive=True)) / 2**20
    return {
        "engine": engine_name,
        "start_s": start_s,
        "seconds": seconds,
        "samples": samples,
        "tokens": tokens,
        "tok_s": tokens / seconds,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "engine_rss_mib": engine_rss,
    }


def _run_child(args: argparse.Namespace, engine: str) -> dict[str, Any]:
    """One phase in a fresh interpreter; its last stdout line is its JSON result."""
    sets = [part for pair in args.set for part in ("--set", pair)]
    command = [sys.executable, __file__, "--recipe", args.recipe, "--records", str(args.records), *sets]
    done = subprocess.run([*command, "--phase", engine], stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _table(results: dict[str, dict[str, Any]]) -> Table:
    table = Table(title="hidden-state capture: vLLM against transformers")
    for column in ("engine", "start s", "seconds", "tokens", "tok/s", "vs transformers", "peak RSS MiB", "engine MiB"):
        table.add_column(column, justify="left" if column == "engine" else "right")
    base = results["transformers"]["tok_s"]
    for name, r in results.items():
        table.add_row(
            name,
            f"{r['start_s']:.1f}",
            f"{r['seconds']:.2f}",
            str(r["tokens"]),
            f"{r['tok_s']:.0f}",
            f"{r['tok_s'] / base:.2f}x",
            f"{r['peak_rss_mib']:.0f}",
            f"{r['engine_rss_mib']:.0f}",
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(REPO / DEFAULT_RECIPE))
    parser.add_argument("--records", type=int, default=64, help="first train records captured")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="recipe override")
    parser.add_argument("--phase", choices=ENGINES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        with tempfile.TemporaryDirectory(prefix="bench_capture-") as tmp:  # vLLM's spool goes under it
            print(json.dumps(_phase(args, args.phase, tmp)))
        return
    recipe = load_recipe(args.recipe, parse_overrides(args.set))
    if recipe.data.regenerate.enabled:
        parser.error("data.regenerate.enabled: this measures capture alone; set it to false")
    results = {name: _run_child(args, name) for name in ENGINES}
    counts = {name: (r["samples"], r["tokens"]) for name, r in results.items()}
    if len(set(counts.values())) != 1:
        raise SystemExit(f"engines saw different (samples, tokens): {counts}")
    summary = {
        "recipe": args.recipe,
        "records": args.records,
        "samples": results["vllm"]["samples"],
        "tokens": results["vllm"]["tokens"],
        "max_length": recipe.data.max_length,
        "storage_dtype": recipe.generation.storage_dtype,
        **{f"{name}_tok_s": r["tok_s"] for name, r in results.items()},
        "vllm_vs_transformers": results["vllm"]["tok_s"] / results["transformers"]["tok_s"],
        "vllm_start_s": results["vllm"]["start_s"],
        "phases": results,
    }
    print(json.dumps(summary))
    Console(stderr=True).print(_table(results))


if __name__ == "__main__":
    run_script(main)
