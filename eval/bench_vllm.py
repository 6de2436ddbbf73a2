"""Benchmark vLLM as the serving engine for our draft, next to the project's own loop.

    .venv/bin/python eval/bench_vllm.py                                  # recipes/eagle3.yaml, its best draft
    .venv/bin/python eval/bench_vllm.py --recipe recipes/peagle.yaml --ks 1,3,5,7 --prompts 8 --max-new-tokens 64 \\
        --suites eval/suites/sharegpt-held-out.yaml,eval/suites/mt-bench.yaml

1. `verify --engine vllm` on the suites: target-only decoding, the draft at each K of --ks and vLLM's draftless
   `ngram` method, one request at a time and all prompts at once, greedy (and --temperatures).
2. The project's own loop on the same prompts at K = --parity-k, greedy: acceptance-length parity.

The measured break-even AL (draft cost included) is tokens per target pass / speedup of the run itself: the AL at
which that run would have matched target-only decoding. Prints one JSON line with every figure, and tables.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from speculators_train.errors import run_script
from speculators_train.layout import checkpoints_dir
from speculators_train.recipe import DEFAULT_RECIPE, load_recipe
from speculators_train.schema import parse_overrides
from speculators_train.verify.run import verify


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(DEFAULT_RECIPE))
    parser.add_argument("--draft", help="checkpoint or checkpoints dir; default: the recipe's best")
    parser.add_argument("--suites", help="comma-separated suite YAMLs; default: eval.suites")
    parser.add_argument("--prompts", type=int, help="prompts per suite (default: each suite's)")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--ks", default="1,3,5,7", help="K values run in vLLM with the draft")
    parser.add_argument("--temperatures", default="0", help="comma-separated; greedy rows check identity")
    parser.add_argument("--parity-k", type=int, default=3, help="K at which the native loop runs for parity")
    parser.add_argument("--no-native", action="store_true", help="skip the native loop (no parity figure)")
    parser.add_argument("--no-batch", action="store_true", help="only one request at a time")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    overrides = parse_overrides(args.set)
    if args.suites:
        overrides["eval.suites"] = args.suites.split(",")
    if args.prompts:
        overrides["eval.num_prompts"] = args.prompts
    if args.max_new_tokens:
        overrides["eval.max_new_tokens"] = args.max_new_tokens
    ks = [int(k) for k in args.ks.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    engine_overrides = {
        **overrides,
        "eval.engine": "vllm",
        "eval.vllm.speculative_tokens": ks,
        "eval.vllm.batch": not args.no_batch,
        "eval.temperatures": temperatures,
    }
    recipe = load_recipe(args.recipe, engine_overrides)
    draft = Path(args.draft) if args.draft else checkpoints_dir(recipe.run_dir)
    out_dir, engine_records = verify(recipe, draft)
    native = []
    if not args.no_native:
        native_recipe = load_recipe(
            args.recipe, {**overrides, "eval.engine": "native", "eval.num_speculative_tokens": args.parity_k}
        )
        _, native = verify(native_recipe, draft)

    summary = {"vllm_version": engine_records[0]["vllm_version"], "results": str(out_dir), "runs": [], "parity": []}
    for r in engine_records:
        row = {
            key: r[key]
            for key in ("suite", "shape", "batch", "temperature", "acceptance_length", "per_position_acceptance")
        }
        row.update(
            tokens_per_target_pass=r["tokens_per_target_pass"],
            speedup=r["speedup"],
            target_only_tokens_per_s=r["target_only_tokens_per_s"],
            speculative_tokens_per_s=r["speculative_tokens_per_s"],
            identical=r.get("greedy_identical_outputs", "-"),
            break_even_al_measured=r["tokens_per_target_pass"] / r["speedup"],
            engine_start_seconds=r["engine_start_seconds"],
        )
        summary["runs"].append(row)
    for n in native:
        for r in engine_records:
            same = (r["suite"], r["num_speculative_tokens"], r["temperature"]) == (
                n["suite"],
                n["num_speculative_tokens"],
                n["temperature"],
            )
            if same and r["method"] == "draft" and r["batch"] == 1:
                summary["parity"].append(
                    {
                        "suite": n["suite"],
                        "k": n["num_speculative_tokens"],
                        "native_al": n["acceptance_length"],
                        "vllm_al": r["acceptance_length"],
                        "gap": r["acceptance_length"] / n["acceptance_length"] - 1,
                        "native_per_position": n["per_position_acceptance"],
                        "vllm_per_position": r["per_position_acceptance"],
                        "native_speedup": n["speedup"],
                        "vllm_speedup": r["speedup"],
                    }
                )
    print(json.dumps(summary))

    console = Console()
    table = Table(title=f"vLLM {summary['vllm_version']}: {recipe.name}")
    for col in ("suite", "method", "batch", "T", "AL", "per position", "tok/pass", "tok/s", "speedup",
                "break-even AL", "identical"):  # fmt: skip
        table.add_column(col)
    for row in summary["runs"]:
        table.add_row(row["suite"], row["shape"], str(row["batch"]), f"{row['temperature']:g}",
                      f"{row['acceptance_length']:.3f}", " ".join(f"{x:.2f}" for x in row["per_position_acceptance"]),
                      f"{row['tokens_per_target_pass']:.2f}", f"{row['speculative_tokens_per_s']:.1f}",
                      f"{row['speedup']:.2f}x", f"{row['break_even_al_measured']:.2f}", row["identical"])  # fmt: skip
    console.print(table)
    if summary["parity"]:
        parity = Table(title="AL parity: the project's loop vs vLLM, same prompts, greedy, batch 1")
        for col in ("suite", "K", "native AL", "vLLM AL", "gap", "native speedup", "vLLM speedup"):
            parity.add_column(col)
        for p in summary["parity"]:
            parity.add_row(p["suite"], str(p["k"]), f"{p['native_al']:.3f}", f"{p['vllm_al']:.3f}", f"{p['gap']:+.1%}",
                           f"{p['native_speedup']:.2f}x", f"{p['vllm_speedup']:.2f}x")  # fmt: skip
        console.print(parity)


if __name__ == "__main__":
    run_script(main)
