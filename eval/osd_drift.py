"""Drift experiment for online distillation: a draft trained on ShareGPT chat meets coding traffic.

    .venv/bin/python eval/osd_drift.py                          # recipes/osd.yaml, 192 coding requests
    .venv/bin/python eval/osd_drift.py --records 320 --max-new-tokens 128
    .venv/bin/python eval/osd_drift.py --set osd.init_from=runs/x/train/checkpoints --set output_dir=runs/osd-x

1. Builds production-style logs (OpenAI chat JSONL) from the shifted domain: ShareGPT coding requests (the
   `sharegpt-code` suite's selection, never in the draft's training split) answered greedily by the target, as a
   server running it would answer them.
2. Runs `speculators-train osd` on them from the recipe's `osd.init_from` draft (the demo EAGLE-3 draft).
3. Reports teacher-forced acceptance length on the held-out slice of the coding logs and on the general chat
   suite, before (the starting draft) and after (the promoted version), and the real verify loop's greedy
   acceptance length on coding requests the logs never contained (`--verify-prompts`), as a JSON line and a table.
Everything lands in <run dir>/ (logs/, osd/); rerunning resumes instead of starting over.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from speculators_train.errors import run_script
from speculators_train.files import atomic_write_bytes
from speculators_train.layout import version_checkpoint, version_dir
from speculators_train.osd.distill import OnlineDistiller
from speculators_train.proposal import Sampling
from speculators_train.recipe import load_recipe
from speculators_train.schema import parse_overrides
from speculators_train.target import load_target
from speculators_train.verify.decoder import SpeculativeDecoder
from speculators_train.verify.run import run_speculative, verify_packing
from speculators_train.verify.suites import Suite, answered, load_suite

REPO = Path(__file__).resolve().parents[1]


def coding_logs(recipe, target, records: int, max_new_tokens: int, out: Path) -> None:
    """The shifted-domain traffic, generated once (kept if present)."""
    if out.is_file():
        return
    suite = load_suite(REPO / "eval" / "suites" / "sharegpt-code.yaml", recipe, target, records)
    lines = []
    for conv in answered(suite, target, recipe, max_new_tokens):
        *request, reply = conv.messages
        lines.append(json.dumps({"id": conv.id, "messages": list(request), "response": reply["content"]}))
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, ("\n".join(lines) + "\n").encode())


def unseen_coding(recipe, target, logs: Path, count: int) -> Suite:
    """Coding requests of the same suite that are not in the logs: the shifted domain, never distilled on."""
    seen = {json.loads(line)["id"] for line in logs.read_text().splitlines() if line.strip()}
    wanted = 2 * (len(seen) + count)  # the logs were made from the suite's first requests
    suite = load_suite(REPO / "eval" / "suites" / "sharegpt-code.yaml", recipe, target, wanted)
    suite.prompts = [p for p in suite.prompts if p.id not in seen][:count]
    return suite


def real_acceptance(recipe, target, family, draft, suite: Suite, max_new_tokens: int) -> tuple[float, list[list[int]]]:
    """Greedy speculative decoding with K = eval.num_speculative_tokens: (acceptance length, the outputs)."""
    k = recipe.eval.num_speculative_tokens
    decoder = SpeculativeDecoder(target, family.proposer(draft, target), Sampling(0.0), k)
    bar = tqdm(total=len(suite.prompts), unit="prompt", desc="verify loop")
    with bar, verify_packing(target, draft, [(k, None)]):
        runs = run_speculative(decoder, target, suite, max_new_tokens, recipe.seed, bar)
    steps = [a for run in runs for a in run.accepted]
    return 1 + sum(steps) / len(steps), [run.tokens for run in runs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "osd.yaml"))
    parser.add_argument("--records", type=int, default=192)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--verify-prompts", type=int, default=12, help="unseen coding requests for the verify loop")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe key")
    args = parser.parse_args()
    if args.verify_prompts < 1:
        parser.error("--verify-prompts must be at least 1")
    recipe = load_recipe(args.recipe, parse_overrides(args.set))
    target = load_target(recipe.target)
    logs = recipe.run_dir / "logs"
    started = time.perf_counter()
    coding_logs(recipe, target, args.records, args.max_new_tokens, logs / "coding.jsonl")
    generated = time.perf_counter()
    distiller = OnlineDistiller(recipe, logs, target)
    distiller.run()
    k = recipe.eval.num_speculative_tokens
    start_path = version_checkpoint(version_dir(distiller.root, 0))
    drafts = {"before": distiller.prepare(start_path), "after": distiller.draft}
    acceptance = distiller.scorer.acceptance
    before, after = (
        {"log": acceptance(drafts[when], distiller.held_out), "general": acceptance(drafts[when], distiller.general)}
        for when in ("before", "after")
    )
    unseen = unseen_coding(recipe, target, logs / "coding.jsonl", args.verify_prompts)
    family = distiller.family
    real = {when: real_acceptance(recipe, target, family, drafts[when], unseen, args.max_new_tokens) for when in drafts}
    record = {
        "records": distiller.progress["records_seen"],
        "updates": distiller.progress["updates"],
        "version": distiller.progress["version"],
        "k": k,
        "held_out_log_records": len(distiller.held_out),
        "general_records": len(distiller.general),
        "coding_al_before": before["log"],
        "coding_al_after": after["log"],
        "general_al_before": before["general"],
        "general_al_after": after["general"],
        "verify_prompts": len(unseen.prompts),
        "verify_coding_al_before": real["before"][0],
        "verify_coding_al_after": real["after"][0],
        "verify_outputs_identical": real["before"][1] == real["after"][1],
        "divergence": recipe.osd.divergence,
        "log_generation_s": generated - started,
        "osd_s": time.perf_counter() - generated,
    }
    print(json.dumps(record))
    table = Table(title=f"OSD drift: {record['records']} coding log records, {record['updates']} updates")
    for column in ("suite", "AL before", "AL after", "change"):
        table.add_column(column, justify="right")
    for name, key in (("coding logs (held out)", "log"), ("general chat", "general")):
        table.add_row(name, f"{before[key]:.3f}", f"{after[key]:.3f}", f"{after[key] - before[key]:+.3f}")
    (al_before, _), (al_after, _) = real["before"], real["after"]
    name = f"unseen coding, verify loop ({len(unseen.prompts)})"
    table.add_row(name, f"{al_before:.3f}", f"{al_after:.3f}", f"{al_after - al_before:+.3f}")
    Console(file=sys.stderr).print(table)
    atomic_write_bytes(distiller.root / "drift.json", yaml.safe_dump(record).encode())


if __name__ == "__main__":
    run_script(main)
