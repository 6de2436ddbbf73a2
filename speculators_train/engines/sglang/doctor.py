"""Doctor for SGLang: the export as SGLang's loader reads it, by its rules applied here (SGLang does not run on this
machine; each format says how SGLang reads it, `ExportFormat.sglang_reading`)."""

from __future__ import annotations

from typing import Any

from speculators_train.architectures import text_config
from speculators_train.doctor.report import Check
from speculators_train.doctor.serve import ServedExport
from speculators_train.families.base import ExportFormat, LoadedDraft


def check(served: ServedExport) -> Check:
    layers = text_config(served.target_config).num_hidden_layers
    return check_sglang(served.fmt, served.loaded, served.on_disk, layers)


def check_sglang(fmt: ExportFormat, loaded: LoadedDraft, on_disk: dict[str, Any], target_num_layers: int) -> Check:
    """The export as SGLang's loader reads it (its rules, applied here: SGLang does not run on this machine)."""
    name = "SGLang reads the export as trained"
    diffs = fmt.sglang_reading(loaded.draft, on_disk, target_num_layers)
    if diffs is None:
        return Check(name, "skip", f"SGLang does not load the {fmt.name} format of a {loaded.family.title}")
    if diffs:
        lines = [f"{field}: trained {a!r}, SGLang will use {b!r}" for field, a, b in diffs]
        return Check(name, "fail", "; ".join(lines), f"export again from {loaded.path} (`--format sglang --force`)")
    return Check(name, "pass", "aux layer ids after SGLang's +1, vocabulary, lm_head and norm flags as trained")
