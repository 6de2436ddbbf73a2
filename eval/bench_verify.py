"""Benchmark real speculative decoding: acceptance length and speedup over target-only decoding.

    .venv/bin/python eval/bench_verify.py                                   # recipes/eagle3.yaml, its best draft
    .venv/bin/python eval/bench_verify.py --ks 3,5,7 --temperatures 0,1 --prompts 12 --max-new-tokens 96
    .venv/bin/python eval/bench_verify.py --recipe recipes/medusa.yaml --ks 3,4     # heads: chain, both tree shapes
    .venv/bin/python eval/bench_verify.py --ks 1 --trees 4x1x4,4x2x8,4x5x24        # small trees for a CPU

On one suite (default: the recipe's first), decodes each prompt target-only (the baseline) and then, back to
back so that machine noise hits them alike, speculatively with each chain K (at most what the draft proposes per
step), with each `--trees` shape or else the recipe's tree in every shape the draft's family grows (dynamic, and for
heads one measured from per-head accuracies) and, greedy only, with an oracle draft (the target's own tokens:
acceptance length K+1), which shows the ceiling this machine allows. Each temperature starts with an untimed warm-up;
`--set target.cpu_packed_weights=false` measures CPU decoding on the default kernels.
Prints one JSON line per setting and a table with where the time goes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from speculators_train.errors import run_script
from speculators_train.layout import checkpoints_dir
from speculators_train.proposal import Sampling, TreeSpec
from speculators_train.recipe import DEFAULT_RECIPE, load_recipe
from speculators_train.schema import parse_overrides
from speculators_train.target import Target, load_target
from speculators_train.verify.decoder import Generation, SpeculativeDecoder
from speculators_train.verify.oracle import OracleProposer
from speculators_train.verify.report import score, speedup_cell
from speculators_train.verify.run import (
    load_draft_for,
    reuse,
    run_paired,
    sampling_at,
    shape_of,
    verify_packing,
    warm_up,
)
from speculators_train.verify.suites import load_suite

REPO = Path(__file__).resolve().parents[1]


def oracle(target: Target, k: int) -> Callable[[list[int], Generation], SpeculativeDecoder]:
    """Per prompt, a greedy decoder whose draft proposes the target's own next tokens (from the baseline)."""
    return lambda ids, base: SpeculativeDecoder(target, OracleProposer(ids + base.tokens), Sampling(), k)


def tree_sizes(text: str) -> list[tuple[int, ...]]:
    """'4x5x24,4x1x4' -> [(4, 5, 24), (4, 1, 4)] (top_k, depth, budget)."""
    out = []
    for spec in text.split(","):
        fields = spec.lower().split("x")
        if len(fields) != 3 or not all(f.isdigit() and int(f) > 0 for f in fields):
            raise argparse.ArgumentTypeError(f"{spec!r} is not TOP_KxDEPTHxBUDGET with three positive integers")
        out.append(tuple(map(int, fields)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(REPO / DEFAULT_RECIPE))
    parser.add_argument("--draft", help="checkpoint or checkpoints dir; default: the recipe's best")
    parser.add_argument("--ks", default="3,5,7")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--no-tree", action="store_true")
    parser.add_argument(
        "--trees",
        type=tree_sizes,
        default=[],
        help="dynamic trees as TOP_KxDEPTHxBUDGET, comma-separated (e.g. 4x5x24,4x2x8); default: the recipe's",
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    recipe = load_recipe(args.recipe, parse_overrides(args.set))
    target = load_target(recipe.target)
    draft_path = Path(args.draft) if args.draft else checkpoints_dir(recipe.run_dir)
    loaded = load_draft_for(target, draft_path)
    family, draft = loaded.family, loaded.draft
    suite_path = recipe.resolve_path(recipe.eval.suites[0], "eval.suites")
    suite = load_suite(suite_path, recipe, target, args.prompts)
    ks = sorted({family.draft_tokens(draft, int(k)) for k in args.ks.split(",")})
    shapes: list[tuple[str, int, TreeSpec | None]] = [(f"chain(K={k})", k, None) for k in ks]
    # (tree shape, (top_k, depth, budget) or None for the recipe's sizes)
    if args.trees:
        trees = [("dynamic", fields) for fields in args.trees]
    else:
        trees = [] if args.no_tree else [(t, None) for t in family.settings.tree_shapes]
    for tree_shape, fields in trees:
        settings = recipe.model_copy(deep=True)
        settings.eval.mode, settings.eval.tree.shape = "tree", tree_shape
        if fields:
            settings.eval.tree.top_k, settings.eval.tree.depth, settings.eval.tree.budget = fields
        shapes.append(shape_of(settings.eval, loaded))
    oracle_k = 5
    widths = [(k, tree) for _, k, tree in shapes] + [(oracle_k, None)]
    records = []
    with verify_packing(target, draft, widths):
        for temperature in map(float, args.temperatures.split(",")):
            sampling = sampling_at(recipe.eval, temperature)
            settings = [  # (shape, K, top_p, decoder per prompt)
                (
                    shape,
                    k,
                    sampling.top_p,
                    reuse(SpeculativeDecoder(target, family.proposer(draft, target), sampling, k, tree)),
                )
                for shape, k, tree in shapes
            ]
            if temperature == 0:  # the ceiling: a draft that is always right
                settings.append((f"oracle chain(K={oracle_k})", oracle_k, 1.0, oracle(target, oracle_k)))
            decoders = [pick for *_, pick in settings]
            with tqdm(total=(len(decoders) + 1) * len(suite.prompts), unit="prompt", desc=f"T={temperature:g}") as bar:
                warm_up(target, SpeculativeDecoder(target, family.proposer(draft, target), sampling, ks[-1]), suite)
                baseline, runs = run_paired(target, suite, args.max_new_tokens, sampling, recipe.seed, bar, decoders)
            for (shape, k, top_p, _), spec in zip(settings, runs, strict=True):
                records.append(score(suite.config.name, shape, k, temperature, top_p, spec, baseline))
    for record in records:
        record.pop("per_prompt_acceptance_length")
        # the draft's own cost per verify step (its extends and proposals), which K multiplies for a sequential draft
        record["draft_ms_per_step"] = 1000 * record["seconds"]["spec_draft"] / max(record["steps"], 1)
        record.update(device=str(target.model.device), draft=str(draft_path), max_new_tokens=args.max_new_tokens)
        print(json.dumps(record))
    table = Table(title=f"{suite.config.name}: {len(suite.prompts)} prompts x {args.max_new_tokens} new tokens")
    for column in (
        "shape",
        "T",
        "AL",
        "per-position",
        "target tok/s",
        "spec tok/s",
        "speedup (prompt IQR)",
        "draft/verify/other s",
        "draft ms/step",
    ):
        table.add_column(column, justify="right")
    for r in records:
        s = r["seconds"]
        table.add_row(
            r["shape"],
            f"{r['temperature']:g}",
            f"{r['acceptance_length']:.2f}",
            " ".join(f"{x:.2f}" for x in r["per_position_acceptance"]),
            f"{r['target_only_tokens_per_s']:.1f}",
            f"{r['speculative_tokens_per_s']:.1f}",
            speedup_cell(r),
            f"{s['spec_draft']:.1f}/{s['spec_verify']:.1f}/{s['spec_prefill'] + s['spec_bookkeeping']:.1f}",
            f"{r['draft_ms_per_step']:.1f}",
        )
    Console(file=sys.stderr).print(table)


if __name__ == "__main__":
    run_script(main)
