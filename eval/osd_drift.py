"""Drift experiment for online distillation: a draft trained on ShareGPT chat meets coding traffic.

    .venv/bin/python eval/osd_drift.py                          # recipes/osd.yaml, 192 coding requests
    .venv/bin/python eval/osd_drift.py --records 320 --max-new-tokens 128
    .venv/bin/python eval/osd_drift.py --set osd.init_from=runs/x/train/checkpoints --set output_dir=runs/osd-x

1. Builds production-style logs (OpenAI chat JSONL) from the shifted domain: ShareGPT coding requests (the
   `sharegpt-code` suite's selection, never in the draft's training split) answered greedily by the target, as a
   server running it would answer them.
2. Runs `speculators-train osd` on them from the recipe's `osd.init_from` draft (the demo EAGLE-3 draft).
3. Reports teacher-forced acceptance length on the held-out slice of the coding logs and on the general chat
   suite, before (the starting draft) and after (the promoted version), as a JSON line and a table.
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

from speculators_train.files import atomic_write_bytes
from speculators_train.osd.distill import OnlineDistiller, acceptance
from speculators_train.recipe import load_recipe, parse_overrides
from speculators_train.target import load_target
from speculators_train.training.checkpoint import load_draft
from speculators_train.verify.suites import answered, load_suite

REPO = Path(__file__).resolve().parents[1]


def coding_logs(recipe, target, records: int, max_new_tokens: int, out: Path) -> None:
    """The shifted-domain traffic, generated once (kept if present)."""
    if out.is_file():
        return
    suite = load_suite(REPO / "eval" / "suites" / "sharegpt-code.yaml", recipe, target.tokenizer, records)
    lines = []
    for conv in answered(suite, target, recipe, max_new_tokens):
        *request, reply = conv.messages
        lines.append(json.dumps({"id": conv.id, "messages": list(request), "response": reply["content"]}))
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, ("\n".join(lines) + "\n").encode())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "osd.yaml"))
    parser.add_argument("--records", type=int, default=192)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe key")
    args = parser.parse_args()
    recipe = load_recipe(args.recipe, parse_overrides(args.set))
    target = load_target(recipe.target)
    logs = recipe.run_dir / "logs"
    started = time.perf_counter()
    coding_logs(recipe, target, args.records, args.max_new_tokens, logs / "coding.jsonl")
    generated = time.perf_counter()
    distiller = OnlineDistiller(recipe, logs, target)
    distiller.run()
    k = recipe.eval.num_speculative_tokens
    start_path = distiller.root / "versions" / "v0000" / "checkpoint"
    drafts = {"before": distiller.prepare(load_draft(start_path), start_path), "after": distiller.draft}
    before, after = (
        {
            "log": acceptance(drafts[when], distiller.head, distiller.held_out, k),
            "general": acceptance(drafts[when], distiller.head, distiller.general, k),
        }
        for when in ("before", "after")
    )
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
    Console(file=sys.stderr).print(table)
    atomic_write_bytes(distiller.root / "drift.json", yaml.safe_dump(record).encode())


if __name__ == "__main__":
    main()
