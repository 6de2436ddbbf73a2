"""Benchmark the training strategies side by side on one machine: DDP, DeepSpeed ZeRO-2 and -3, FSDP2 over N ranks.

    .venv/bin/python eval/bench_distributed.py --steps 10                       # CPU: 2 gloo ranks, recipes/eagle3.yaml
    .venv/bin/python eval/bench_distributed.py --ranks 8 --strategies ddp,fsdp2   # a GPU machine

Each strategy trains `--steps` optimizer steps of the recipe (its own run directory, the recipe's stored hidden
states linked in) under `torchrun --nproc_per_node N`. Reports, per strategy: tokens/s (the median of the logged
steps after the first two), wall seconds of the launch (start-up, validation and checkpoints included), the peak
resident memory of the largest rank, rank 0's share of the training state after its first step (the weights it
holds, trainable and frozen, and the optimizer's tensors: `memory/*` in metrics.jsonl), and the last loss. Prints
one JSON line and a table.
Run `speculators-train generate <recipe>` first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch
from rich.console import Console
from rich.table import Table

from speculators_train.errors import UserError, run_script
from speculators_train.layout import MANIFEST, METRICS, hidden_states_dir, train_dir
from speculators_train.recipe import DEFAULT_RECIPE, load_recipe
from speculators_train.schema import parse_overrides

REPO = Path(__file__).resolve().parents[1]
STRATEGIES = {
    "ddp": [],
    "zero2": ["training.deepspeed={zero_stage: 2}"],
    "zero3": ["training.deepspeed={zero_stage: 3}"],
    "fsdp2": ["training.fsdp={}"],
    "fsdp2-keep": ["training.fsdp={reshard_after_forward: false}"],
}


def launch(recipe: Path, out: Path, ranks: int, sets: list[str]) -> tuple[float, float]:
    """One torchrun launch; (wall seconds, peak RSS in MiB of the largest rank), sampled every 0.1 s."""
    cuda = torch.cuda.is_available()
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks))}
    if not cuda:
        env["ACCELERATE_USE_CPU"] = "1"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks)]
    command += ["-m", "speculators_train", "train", str(recipe)]
    for pair in [*sets, f"output_dir={out}"]:  # last: it wins over an output_dir in --set (where the states are)
        command += ["--set", pair]
    started = time.perf_counter()
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak: dict[int, int] = {}
    while proc.poll() is None:
        try:
            for child in psutil.Process(proc.pid).children(recursive=True):
                peak[child.pid] = max(peak.get(child.pid, 0), child.memory_info().rss)
        except psutil.Error:
            pass
        time.sleep(0.1)
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        raise UserError(f"{' '.join(command)} failed:\n{proc.stderr.read()[-3000:]}")
    return seconds, max(peak.values(), default=0) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(REPO / DEFAULT_RECIPE))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    recipe = load_recipe(args.recipe, parse_overrides(args.set))
    states = recipe.hidden_states_dir.resolve()
    if not (states / MANIFEST).is_file():
        raise UserError(f"{states}: no stored hidden states; run `speculators-train generate {args.recipe}` first")
    common = [*args.set, f"training.max_steps={args.steps}", "training.log_every_steps=1"]
    common += ["training.wandb.mode=disabled", "training.save_every_steps=null", "training.eval_every_steps=null"]
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-distributed-") as tmp:
        for name in args.strategies.split(","):
            out = Path(tmp) / name
            out.mkdir()
            hidden_states_dir(out).symlink_to(states)
            seconds, rss = launch(Path(args.recipe), out, args.ranks, [*common, *STRATEGIES[name]])
            lines = [json.loads(x) for x in (train_dir(out) / METRICS).read_text().splitlines()]
            rates = [r["tokens_per_s"] for r in lines if "tokens_per_s" in r][2:]
            memory = next(r for r in lines if "memory/weights_mib" in r)
            results.append(
                {
                    "strategy": name,
                    "tokens_per_s": statistics.median(rates) if rates else None,
                    "wall_s": seconds,
                    "peak_rank_rss_mib": rss,
                    "rank_weights_mib": memory["memory/weights_mib"],
                    "rank_optimizer_mib": memory["memory/optimizer_mib"],
                    "final_loss": [r["loss"] for r in lines if "loss" in r][-1],
                }
            )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(json.dumps({"device": device, "ranks": args.ranks, "recipe": args.recipe, "steps": args.steps,
                      "overrides": args.set, "results": results}))  # fmt: skip
    table = Table(title=f"{recipe.draft.family} on {args.ranks} {device} ranks, {args.steps} steps")
    columns = ("strategy", "tok/s", "wall s", "rank weights MiB", "rank optimizer MiB", "peak rank RSS MiB", "loss")
    for column in columns:
        table.add_column(column, justify="right")
    for r in results:
        rate = f"{r['tokens_per_s']:.0f}" if r["tokens_per_s"] else "-"
        state = [f"{r[k]:.1f}" for k in ("rank_weights_mib", "rank_optimizer_mib")]
        memory, loss = f"{r['peak_rank_rss_mib']:.0f}", f"{r['final_loss']:.3f}"
        table.add_row(r["strategy"], rate, f"{r['wall_s']:.0f}", *state, memory, loss)
    Console(stderr=True).print(table)


if __name__ == "__main__":
    run_script(main)
