"""`doctor`'s K against a brute-force sweep: the verify loop at chain K = 1..K on the same prompts.

    .venv/bin/python eval/bench_k.py                              # recipes/eagle3.yaml, its best draft, K = 1..5
    .venv/bin/python eval/bench_k.py --max-k 7 --prompts 12 --max-new-tokens 96 --batch 8

Each prompt is decoded target-only and then at every K back to back (`run_paired`), greedily. The expected speedup
per K is computed from the largest K's record alone, as `doctor` computes it from a verify run (acceptance per
position, the measured verify, draft and one-token costs), and set beside the speedup the loop measured at each K.
`--batch B` adds the expected speedups at B concurrent requests, from the target's passes timed here at 1 and at B
rows. Prints one JSON line on stdout and a table on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from speculators_train.doctor.k import batch_costs, check_sweep
from speculators_train.doctor.sweep import sweep_k
from speculators_train.errors import run_script
from speculators_train.export.k import best_k, expected_speedups
from speculators_train.layout import checkpoints_dir
from speculators_train.recipe import DEFAULT_RECIPE, load_recipe
from speculators_train.schema import parse_overrides
from speculators_train.target import load_target
from speculators_train.verify.suites import load_suite

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(REPO / DEFAULT_RECIPE))
    parser.add_argument("--draft", help="checkpoint or checkpoints dir; default: the recipe's best")
    parser.add_argument("--max-k", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1, help="also the expected speedups at this many requests")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    recipe = load_recipe(args.recipe, parse_overrides(args.set))
    target = load_target(recipe.target)
    draft = Path(args.draft) if args.draft else checkpoints_dir(recipe.run_dir)
    suite = load_suite(recipe.resolve_path(recipe.eval.suites[0], "eval.suites"), recipe, target, args.prompts)
    records = sweep_k(target, draft, suite, args.max_k, args.max_new_tokens, recipe.seed)
    largest = records[-1]
    predicted = expected_speedups(largest)
    measured = {r["num_speculative_tokens"]: r["speedup"] for r in records}
    out = {
        "suite": suite.config.name,
        "prompts": len(suite.prompts),
        "max_new_tokens": args.max_new_tokens,
        "draft": str(draft),
        "measured_speedup": measured,
        "acceptance_length": {r["num_speculative_tokens"]: r["acceptance_length"] for r in records},
        "predicted_speedup": predicted,
        "measured_best_k": max(measured, key=measured.__getitem__),
        "predicted_best_k": best_k(predicted),
        "check": check_sweep(records).status,
    }
    if args.batch > 1:
        at_batch = expected_speedups(largest, batch_costs(target, largest, args.batch, suite.prompts[0].ids))
        out.update(batch=args.batch, predicted_speedup_at_batch=at_batch, predicted_best_k_at_batch=best_k(at_batch))
    print(json.dumps(out))
    table = Table(title=f"{suite.config.name}: {len(suite.prompts)} prompts x {args.max_new_tokens} new tokens")
    for column in ("K", "AL", "measured speedup", "predicted (from the largest K)", *(
        [f"predicted at batch {args.batch}"] if args.batch > 1 else [])):  # fmt: skip
        table.add_column(column, justify="right")
    for r in records:
        k = r["num_speculative_tokens"]
        row = [str(k), f"{r['acceptance_length']:.2f}", f"{measured[k]:.2f}x", f"{predicted[k]:.2f}x"]
        table.add_row(*row, *([f"{out['predicted_speedup_at_batch'][k]:.2f}x"] if args.batch > 1 else []))
    Console(file=sys.stderr).print(table)
    Console(file=sys.stderr).print(f"best K: measured {out['measured_best_k']}, predicted {out['predicted_best_k']}")


if __name__ == "__main__":
    run_script(main)
