"""Benchmark training throughput of the recipe's draft family on its generated hidden states.

    .venv/bin/python eval/bench_train.py --steps 20                  # CPU, recipes/eagle3.yaml
    .venv/bin/python eval/bench_train.py --steps 50 --set training.batch_size=16   # e.g. on a GPU

Runs `--steps` optimizer steps of the real trainer's training step (after 2 untimed warm-up steps) in a temporary run
directory that reuses the recipe's hidden states, and reports tokens/s (real, unpadded tokens), seconds
per step, peak RSS and, on CUDA, peak allocated GPU memory. Prints one JSON line and a table.
Run `speculators-train generate <recipe>` first.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from speculators_train.errors import run_script
from speculators_train.layout import hidden_states_dir
from speculators_train.recipe import DEFAULT_RECIPE, load_recipe
from speculators_train.schema import parse_overrides
from speculators_train.training.step import train_step
from speculators_train.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(REPO / DEFAULT_RECIPE))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    overrides = parse_overrides(args.set)
    recipe = load_recipe(args.recipe, overrides)
    states = recipe.hidden_states_dir.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        hidden_states_dir(Path(tmp)).symlink_to(states)
        recipe = load_recipe(args.recipe, {**overrides, "output_dir": tmp, "training.wandb.mode": "disabled"})
        trainer = Trainer(recipe)
        model, device = trainer.objective, trainer.accelerator.device
        batches = (batch for batch, _ in trainer.batches.epoch(0, None))

        def step() -> int:
            batch = next(batches)
            train_step(
                trainer.accelerator, model, trainer.optimizer, trainer._to_device(batch), recipe.training.max_grad_norm
            )
            return int(batch["lengths"].sum())

        for _ in range(2):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start, tokens = time.perf_counter(), 0
        for _ in range(args.steps):
            tokens += step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    result = {
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "recipe": args.recipe,
        "overrides": overrides,
        "steps": args.steps,
        "batch_size": recipe.training.batch_size,
        "max_length": recipe.data.max_length,
        "draft": recipe.draft.model_dump(),
        "precision": trainer.accelerator.mixed_precision,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "seconds_per_step": seconds / args.steps,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "cuda_peak_mib": torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None,
    }
    print(json.dumps(result))
    table = Table(title=f"{recipe.draft.family} training throughput")
    for column in ("device", "precision", "batch", "tok/s", "s/step", "peak RSS MiB", "GPU peak MiB"):
        table.add_column(column, justify="right")
    gpu = f"{result['cuda_peak_mib']:.0f}" if result["cuda_peak_mib"] else "-"
    table.add_row(
        result["device"],
        str(result["precision"]),
        str(result["batch_size"]),
        f"{result['tokens_per_s']:.0f}",
        f"{result['seconds_per_step']:.2f}",
        f"{result['peak_rss_mib']:.0f}",
        gpu,
    )
    Console(stderr=True).print(table)


if __name__ == "__main__":
    run_script(main)
