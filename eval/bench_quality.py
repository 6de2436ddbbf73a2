"""Draft quality per unit of compute: every variant trains from scratch for the same budget on the same stored
slice, with the same seed, and is scored the same way, so rows compare.

    .venv/bin/python eval/bench_quality.py --minutes 30 --variant base \
        --variant "norm_before_fc;draft.norm_before_fc=true" --variant "lk;draft.loss=lk_hybrid"

A variant is `NAME[;KEY=VALUE...]`: recipe overrides, as `--set` takes them. The slice is the recipe's hidden states
(default recipes/eagle3-smollm2-quality.yaml; generated first if missing), shared by every variant through a link.
The budget is training time (`training.max_minutes`: validation and checkpoint writes are not counted, and the
learning-rate schedule runs over the time), or `--steps` optimizer steps. Each variant reports:

- the budget actually used: training seconds, optimizer steps, training tokens (and the scoring pass of
  `training.select`, acceptance-guided data, which the training budget does not count);
- teacher-forced held-out AL: 1 + sum of full_acc_i over the draft's TTT steps up to K (the trainer's own
  validation, on the recipe's held-out split), and its per-step full accuracies;
- the real loop's AL at K (chain, greedy), its speedup against the target alone and the draft's milliseconds per
  verify step, on each `--suites` suite (`--prompts` prompts x `--max-new-tokens` tokens, the same prompts for every
  variant).

Variants run one after another (training and verify in subprocesses, so each starts with clean memory); a rerun
resumes a variant whose training was cut short and skips one already scored. `--set` changes the slice itself
(e.g. `data.regenerate.engine=llama.cpp` with its own `output_dir`); `--engine llama.cpp` scores the loop AL in
llama-server instead. Prints one JSON line on stdout and a table on stderr; results also go to
<run>/quality/<name>/quality[-llama.cpp][-kK].json (K other than 5).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from speculators_train.errors import UserError, run_script
from speculators_train.layout import (
    MANIFEST,
    METRICS,
    checkpoints_dir,
    hidden_states_dir,
    latest_checkpoint,
    read_trainer_state,
    train_dir,
    verify_results,
)
from speculators_train.loading import read_json, read_json_object
from speculators_train.recipe import Recipe, load_recipe
from speculators_train.schema import parse_overrides

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "speculators_train"]
SUITES = "eval/suites/sharegpt-held-out.yaml,eval/suites/mt-bench.yaml"


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """'name;key=value;...' -> (name, overrides)."""
    name, *settings = [part.strip() for part in text.split(";")]
    if not name or "=" in name or "/" in name:
        raise UserError(f"--variant {text!r}: start with a name (letters, digits, - or _), then ;key=value pairs")
    return name, parse_overrides(settings)


def _cli(*args: str) -> None:
    """One stage in a subprocess; its output goes to this process's stderr."""
    proc = subprocess.run([*CLI, *args], cwd=REPO, stdout=sys.stderr, env={**os.environ, "WANDB_MODE": "disabled"})
    if proc.returncode:
        raise UserError(f"`speculators-train {' '.join(args)}` failed (exit {proc.returncode}); its output is above")


def _sets(overrides: dict[str, Any]) -> list[str]:
    return [arg for key, value in overrides.items() for arg in ("--set", f"{key}={json.dumps(value)}")]


def train_variant(recipe_path: Path, recipe: Recipe, name: str, overrides: dict[str, Any]) -> Path:
    """Train one variant in its own output_dir, reading the shared slice through a `hidden_states` link."""
    run = recipe.run_dir / "quality" / name
    run.mkdir(parents=True, exist_ok=True)
    link = hidden_states_dir(run)
    if not link.exists():
        link.symlink_to(recipe.hidden_states_dir.resolve(), target_is_directory=True)
    overrides = {"output_dir": str(run), **overrides}
    _cli("train", str(recipe_path), *_sets(overrides))
    return run


def held_out(run: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the last validation record, the trainer state of the latest checkpoint)."""
    records = [json.loads(line) for line in (train_dir(run) / METRICS).read_text().splitlines() if line]
    last = [r for r in records if any(k.startswith("val/") for k in r)][-1]
    state = read_trainer_state(latest_checkpoint(checkpoints_dir(run)))
    return last, state


def loop_al(recipe_path: Path, overrides: dict[str, Any], run: Path, args: argparse.Namespace) -> list[dict]:
    """The real loop at K (chain, greedy) on the suites; the newest results under <run>/verify."""
    evals = {
        "eval.suites": args.suites.split(","),
        "eval.mode": "chain",
        "eval.num_speculative_tokens": args.k,
        "eval.temperatures": [0.0],
        "eval.num_prompts": args.prompts,
        "eval.max_new_tokens": args.max_new_tokens,
    }
    _cli("verify", str(recipe_path), *_sets({"output_dir": str(run), **overrides, **evals}), "--engine", args.engine)
    return read_json(verify_results(run)[0], "verify results")


def draft_ms(record: dict[str, Any]) -> float | None:
    """The draft's milliseconds per verify step (its extends and proposals), from the loop's own timers; None where
    the engine does not report them."""
    seconds, steps = record.get("seconds", {}).get("spec_draft"), record.get("steps")
    return round(1000 * seconds / steps, 2) if seconds is not None and steps else None


def score(recipe_path: Path, recipe: Recipe, name: str, overrides: dict[str, Any], args) -> dict[str, Any]:
    engine = "" if args.engine == "native" else f"-{args.engine}"
    out = recipe.run_dir / "quality" / name / f"quality{engine}{'' if args.k == 5 else f'-k{args.k}'}.json"
    budget = {"training.max_minutes": args.minutes} if args.minutes else {"training.max_steps": args.steps}
    shared = {k: v for k, v in args.base.items() if k != "output_dir"}  # each variant has its own run dir
    overrides = {"training.epochs": 1000, **budget, **shared, **overrides}
    if out.is_file():
        done = read_json_object(out, "quality result")
        loop = done.get("loop", {})
        if done.get("overrides") == overrides and (loop.get("prompts"), loop.get("k")) == (args.prompts, args.k):
            return done
    run = train_variant(recipe_path, recipe, name, overrides)
    last, state = held_out(run)
    # the draft steps validation scored (a family's unroll or depths), up to K
    accs = [a for a in (last.get(f"val/full_acc_{i}") for i in range(args.k)) if a is not None]
    depth = len(accs)
    records = loop_al(recipe_path, overrides, run, args)
    result = {
        "variant": name,
        "engine": args.engine,
        "overrides": overrides,
        "budget": {
            "train_seconds": round(state.get("train_seconds", 0.0), 1),
            "select_seconds": round(state.get("select_seconds", 0.0), 1),  # training.select's scoring pass
            "steps": state["step"],
            "tokens": state["tokens"],
        },
        "teacher_forced": {
            "al": round(1 + sum(accs), 4),
            "depth": depth,
            "full_acc": [round(a, 4) for a in accs],
            "step": last["step"],
        },
        "loop": {
            "k": args.k,
            "prompts": args.prompts,
            "max_new_tokens": args.max_new_tokens,
            "suites": {
                r["suite"]: {
                    "al": round(r["acceptance_length"], 4),
                    "per_position": [round(x, 4) for x in r.get("per_position_acceptance", [])],
                    "speedup": round(r["speedup"], 3),
                    "draft_ms_per_step": draft_ms(r),
                    "greedy_identical": r.get("greedy_identical_outputs"),
                }
                for r in records
            },
        },
    }
    out.write_text(json.dumps(result, indent=2))
    return result


def cell(suite: dict[str, Any]) -> str:
    """'1.350 (1.09x, 4.2 ms)': loop AL, speedup and the draft's ms per step."""
    ms = suite.get("draft_ms_per_step")
    return f"{suite['al']:.3f} ({suite['speedup']:.2f}x{'' if ms is None else f', {ms:.1f} ms'})"


def table(results: list[dict[str, Any]], suites: list[str]) -> Table:
    t = Table(title="draft quality at a fixed budget (same slice, same seed)")
    for col in ("variant", "train min", "steps", "tokens", "TF AL (depth)", *[f"loop AL {s}" for s in suites]):
        t.add_column(col)
    for r in results:
        loop = r["loop"]["suites"]
        t.add_row(
            r["variant"],
            f"{r['budget']['train_seconds'] / 60:.1f}",
            str(r["budget"]["steps"]),
            str(r["budget"]["tokens"]),
            f"{r['teacher_forced']['al']:.3f} ({r['teacher_forced']['depth']})",
            *[cell(loop[s]) if s in loop else "-" for s in suites],
        )
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default=str(REPO / "recipes/eagle3-smollm2-quality.yaml"))
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--minutes", type=float, help="training-time budget per variant (default 30)")
    budget.add_argument("--steps", type=int, help="optimizer steps per variant instead of a time budget")
    parser.add_argument("--variant", action="append", default=[], help="NAME[;KEY=VALUE...] (repeatable)")
    parser.add_argument("--k", type=int, default=5, help="draft tokens per verify step in the loop")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per suite")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--suites", default=SUITES, help="comma-separated suite files")
    parser.add_argument("--engine", choices=["native", "llama.cpp"], default="native", help="the loop that scores AL")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override the slice's recipe")
    args = parser.parse_args()
    args.base = parse_overrides(args.set)
    if args.minutes is None and args.steps is None:
        args.minutes = 30.0
    recipe_path = Path(args.recipe)
    recipe = load_recipe(recipe_path, args.base)
    variants = [parse_variant(v) for v in args.variant or ["base"]]
    for _, overrides in variants:  # a typo stops here, before any generation or training
        load_recipe(recipe_path, {**args.base, **overrides})
    if not (recipe.hidden_states_dir / MANIFEST).is_file():
        _cli("generate", str(recipe_path), *_sets(args.base))
    results = [score(recipe_path, recipe, name, overrides, args) for name, overrides in variants]
    print(json.dumps({"recipe": str(recipe_path), "results": results}), flush=True)
    Console(stderr=True).print(table(results, list(results[0]["loop"]["suites"])))


if __name__ == "__main__":
    run_script(main)
