"""Benchmark llama.cpp as the serving engine for our draft, next to the project's own loop.

    .venv/bin/python eval/bench_llamacpp.py                            # recipes/eagle3.yaml, its best draft
    .venv/bin/python eval/bench_llamacpp.py --draft runs/x/train/checkpoints --prompts 10 --max-new-tokens 128 \\
        --suites eval/suites/sharegpt-held-out.yaml,eval/suites/mt-bench.yaml

1. `verify --engine llama.cpp` on the suites: target-only decoding, the draft at each K of
   eval.llama_cpp.speculative_tokens and the draftless n-gram methods, on the recipe's GGUF and on an F32 GGUF.
2. The project's own loop on the same prompts at K = --parity-k: acceptance-length parity.
3. llama-bench on each target file: the time of one verify batch of K + 1 tokens against one decoded token, at a
   context of --depth tokens. Speculation at K breaks even when AL reaches t(K + 1) / t(1) plus the draft's share;
   the measured break-even AL (draft cost included) is AL / speedup of the run itself.

Prints one JSON line with every figure, and tables.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from speculators_train.engines.llamacpp.build import ensure_built, version
from speculators_train.engines.llamacpp.verify import target_files
from speculators_train.errors import UserError, run_script
from speculators_train.layout import checkpoints_dir
from speculators_train.recipe import DEFAULT_RECIPE, load_recipe
from speculators_train.schema import parse_overrides
from speculators_train.verify.run import verify


def verify_batch_costs(file: Path, max_k: int, depth: int, threads: int | None) -> dict[str, float]:
    """llama-bench: seconds per decoded token (tg) and per batch of n = 2 .. max_k + 1 tokens (pp), at `depth`."""
    sizes = ",".join(str(n) for n in range(2, max_k + 2))
    cmd = [str(ensure_built() / "llama-bench"), "-m", str(file), "-p", sizes, "-n", "32", "-d", str(depth),
           "-r", "5", "-o", "json"]  # fmt: skip
    if threads:
        cmd += ["-t", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise UserError(f"llama-bench failed on {file}: {proc.stderr.strip().splitlines()[-3:]}")
    out: dict[str, float] = {}
    for test in json.loads(proc.stdout):
        if test["n_gen"]:
            out["1"] = test["avg_ns"] / 1e9 / test["n_gen"]
        else:
            out[str(test["n_prompt"])] = test["avg_ns"] / 1e9
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(DEFAULT_RECIPE))
    parser.add_argument("--draft", help="checkpoint or checkpoints dir; default: the recipe's best")
    parser.add_argument("--suites", help="comma-separated suite YAMLs; default: eval.suites")
    parser.add_argument("--prompts", type=int, help="prompts per suite (default: each suite's)")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--parity-k", type=int, default=5, help="K at which the native loop runs for parity")
    parser.add_argument("--depth", type=int, default=256, help="context length for llama-bench's batch costs")
    parser.add_argument("--no-native", action="store_true", help="skip the native loop (no parity figure)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    overrides = parse_overrides(args.set)
    if args.suites:
        overrides["eval.suites"] = args.suites.split(",")
    if args.prompts:
        overrides["eval.num_prompts"] = args.prompts
    if args.max_new_tokens:
        overrides["eval.max_new_tokens"] = args.max_new_tokens
    recipe = load_recipe(args.recipe, {**overrides, "eval.engine": "llama.cpp"})
    draft = Path(args.draft) if args.draft else checkpoints_dir(recipe.run_dir)
    cfg = recipe.eval.llama_cpp

    costs = {name: verify_batch_costs(f, max(cfg.speculative_tokens), args.depth, cfg.threads)
             for name, f in target_files(recipe).items()}  # fmt: skip
    out_dir, engine_records = verify(recipe, draft)
    native = []
    if not args.no_native:
        native_recipe = load_recipe(
            args.recipe, {**overrides, "eval.engine": "native", "eval.num_speculative_tokens": args.parity_k}
        )
        _, native = verify(native_recipe, draft)

    summary = {"llama_cpp_version": version(), "results": str(out_dir), "batch_seconds": costs, "runs": []}
    for r in engine_records:
        t = costs[r["target"]]
        k = r["num_speculative_tokens"]
        row = {key: r[key] for key in ("target", "suite", "shape", "acceptance_length", "tokens_per_target_pass")}
        row.update(
            speedup=r["speedup"],
            target_only_tokens_per_s=r["target_only_tokens_per_s"],
            speculative_tokens_per_s=r["speculative_tokens_per_s"],
            identical=r["greedy_identical_outputs"],
            first_divergence=[d for d in r["first_divergence"] if d is not None],
            break_even_al_measured=r["tokens_per_target_pass"] / r["speedup"],
            verify_cost_ratio=(t[str(k + 1)] / t["1"]) if k and str(k + 1) in t else None,
        )
        summary["runs"].append(row)
    summary["parity"] = []
    for n in native:
        for r in engine_records:
            if r["suite"] == n["suite"] and r["num_speculative_tokens"] == n["num_speculative_tokens"]:
                summary["parity"].append(
                    {
                        "suite": n["suite"],
                        "k": n["num_speculative_tokens"],
                        "target": r["target"],
                        "native_al": n["acceptance_length"],
                        "llama_cpp_al": r["acceptance_length"],
                        "gap": r["acceptance_length"] / n["acceptance_length"] - 1,
                        "native_speedup": n["speedup"],
                        "llama_cpp_speedup": r["speedup"],
                    }
                )
    print(json.dumps(summary))

    console = Console()
    table = Table(title=f"llama.cpp {version()}: {recipe.eval.llama_cpp.targets} targets")
    for col in (
        "target",
        "suite",
        "method",
        "AL",
        "tok/pass",
        "tok/s",
        "speedup",
        "break-even AL",
        "t(K+1)/t(1)",
        "identical",
    ):
        table.add_column(col)
    for row in summary["runs"]:
        ratio = row["verify_cost_ratio"]
        table.add_row(row["target"], row["suite"], row["shape"], f"{row['acceptance_length']:.2f}",
                      f"{row['tokens_per_target_pass']:.2f}", f"{row['speculative_tokens_per_s']:.0f}",
                      f"{row['speedup']:.2f}x", f"{row['break_even_al_measured']:.2f}",
                      "-" if ratio is None else f"{ratio:.2f}", row["identical"])  # fmt: skip
    console.print(table)
    if summary["parity"]:
        parity = Table(title="AL parity: the project's loop vs llama.cpp, same prompts")
        for col in ("suite", "K", "llama.cpp target", "native AL", "llama.cpp AL", "gap"):
            parity.add_column(col)
        for p in summary["parity"]:
            parity.add_row(p["suite"], str(p["k"]), p["target"], f"{p['native_al']:.3f}", f"{p['llama_cpp_al']:.3f}",
                           f"{p['gap']:+.1%}")  # fmt: skip
        console.print(parity)
    target_only = {(r["target"], r["suite"]): r["target_only_tokens_per_s"] for r in engine_records}
    print(f"target-only tokens/s: {target_only}", file=sys.stderr)


if __name__ == "__main__":
    run_script(main)
