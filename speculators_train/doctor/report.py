"""A doctor's findings: one `Check` per question, each passing, warning or failing with the fix; written as a
one-screen summary, Markdown and JSON beside each other, as `verify` writes its results."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from speculators_train.files import atomic_write_bytes, to_json
from speculators_train.layout import DOCTOR_REPORT, DOCTOR_RESULTS

Status = Literal["pass", "warn", "fail", "skip"]


@dataclass
class Check:
    name: str  # what was compared, e.g. "vLLM reads the export as trained"
    status: Status
    detail: str  # what was found: the field, what training used, what the engine will use
    fix: str = ""  # what to do about it (empty when it passes)


def failed(checks: list[Check]) -> bool:
    return any(c.status == "fail" for c in checks)


def markdown(checks: list[Check], heading: str) -> str:
    rows = [f"| {c.status} | {c.name} | {c.detail} | {c.fix or '-'} |" for c in checks]
    return f"# {heading}\n\n| status | check | found | fix |\n|---|---|---|---|\n" + "\n".join(rows) + "\n"


def write(out_dir: Path, checks: list[Check], heading: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out_dir / DOCTOR_RESULTS, (to_json([asdict(c) for c in checks], indent=2) + "\n").encode())
    atomic_write_bytes(out_dir / DOCTOR_REPORT, markdown(checks, heading).encode())
