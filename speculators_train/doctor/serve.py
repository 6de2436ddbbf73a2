"""Train against serve: the export on disk against what the trained checkpoint writes, field by field and tensor
by tensor; each engine then reads both as it would (`engines/<name>/doctor.py`: vLLM's `SpeculatorsConfig`,
llama.cpp's GGUF reader, SGLang's loader rules), so a field edited, dropped or read differently is named with the
value trained and the value the engine will use."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from speculators_train.doctor.report import Check
from speculators_train.families.base import ExportFormat, LoadedDraft
from speculators_train.families.format_common import read_weights
from speculators_train.recipe import Recipe

# Written for people and tools, not read by an engine as a setting of the draft
BOOKKEEPING = ("transformers_version", "speculators_version", "speculators_train_version")
MISSING = "<missing>"
# the verifier's provenance, which `data.check_verifier` judges against the target served now
PROVENANCE = ("speculators_config.verifier.revision", "speculators_config.verifier.config_hash")


@dataclass(frozen=True)
class ServedExport:
    """An export as doctor hands it to the engine that serves it (`Engine.doctor_check`): the `export` folder and
    its config.json (`on_disk`), the checkpoint it came from (`loaded`) in its format `fmt`, what that checkpoint
    writes now (`fresh`: config and tensors), the target's transformers config and the dtype it is served in."""

    recipe: Recipe
    loaded: LoadedDraft
    fmt: ExportFormat
    export: Path
    on_disk: dict[str, Any]
    fresh: tuple[dict[str, Any], dict[str, torch.Tensor]]
    target_config: Any
    dtype: str


def flat(config: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted path: value} of a JSON config's leaves (lists are leaves)."""
    if not isinstance(config, dict):
        return {prefix: config}
    out: dict[str, Any] = {}
    for key, value in config.items():
        out.update(flat(value, f"{prefix}{key}." if isinstance(value, dict) and value else f"{prefix}{key}"))
    return {k.rstrip("."): v for k, v in out.items()}


def config_diffs(trained: dict[str, Any], exported: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(field, trained value, exported value) for each leaf that differs, bookkeeping left out."""
    a, b = flat(trained), flat(exported)
    keys = sorted(k for k in set(a) | set(b) if k.split(".")[-1] not in BOOKKEEPING and k not in PROVENANCE)
    return [(k, a.get(k, MISSING), b.get(k, MISSING)) for k in keys if a.get(k, MISSING) != b.get(k, MISSING)]


def tensor_diffs(trained: dict[str, torch.Tensor], exported: dict[str, torch.Tensor]) -> list[str]:
    out = [f"{name}: not in the export" for name in sorted(set(trained) - set(exported))]
    out += [f"{name}: in the export only" for name in sorted(set(exported) - set(trained))]
    for name in sorted(set(trained) & set(exported)):
        mine, theirs = trained[name], exported[name]
        if mine.shape != theirs.shape:
            out.append(f"{name}: shape {list(theirs.shape)}, trained {list(mine.shape)}")
        elif not torch.equal(mine.to(theirs.dtype), theirs):
            changed = (mine.to(theirs.dtype) != theirs).sum().item()
            out.append(f"{name}: {changed} of {theirs.numel()} values differ from the trained draft's")
    return out


def check_export(
    loaded: LoadedDraft,
    fmt: ExportFormat,
    export: Path,
    on_disk: dict[str, Any],
    fresh: tuple[dict[str, Any], dict[str, torch.Tensor]],
) -> list[Check]:
    """The export at `export` (its config.json: `on_disk`) against `fresh` (what the checkpoint `loaded` writes in
    `fmt`)."""
    config, tensors = fresh
    weights, _ = read_weights(export)
    checks = []
    diffs = config_diffs(config, on_disk)
    lines = [f"{k}: trained {a!r}, the export has {b!r}" for k, a, b in diffs]
    checks.append(
        Check(
            f"{fmt.name} config.json as trained",
            "fail" if lines else "pass",
            "; ".join(lines) or f"every field of {export / 'config.json'} is the trained draft's",
            f"export again from {loaded.path} (`speculators-train export --force`)" if lines else "",
        )
    )
    bad = tensor_diffs(tensors, weights)
    checks.append(
        Check(
            f"{fmt.name} tensors as trained",
            "fail" if bad else "pass",
            "; ".join(bad[:8]) + (f"; and {len(bad) - 8} more" if len(bad) > 8 else "")
            if bad
            else f"{len(weights)} tensors equal the trained draft's",
            f"export again from {loaded.path}; a vocabulary map (d2t/t2d) must come from the training manifest's "
            "token counts"
            if bad
            else "",
        )
    )
    return checks
