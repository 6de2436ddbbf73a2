"""Doctor for llama.cpp, train against serve: the export's `draft.gguf` read through `gguf.GGUFReader` (llama.cpp's own
GGUF package) against a GGUF converted now from the trained checkpoint by the same converter, so a metadata key
(a norm flag, the aux layer ids, the block size) or a tensor that differs is named with the value
trained and the value llama.cpp will read."""

from __future__ import annotations

import filecmp
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from speculators_train.doctor.report import Check
from speculators_train.doctor.serve import ServedExport
from speculators_train.errors import UserError
from speculators_train.export.run import export as write_export
from speculators_train.families.base import LoadedDraft
from speculators_train.recipe import Recipe

NAME = "llama.cpp reads the GGUF as trained"
# The file header's counts (the tensors are compared one by one) and the keys the converter derives from the name
# of the directory it reads (a version, a finetune), which say nothing of the draft
SKIPPED = ("GGUF.", "general.name", "general.basename", "general.finetune", "general.version", "general.size_label",
           "general.base_model.")  # fmt: skip


def check(served: ServedExport) -> Check:
    return check_gguf(served.recipe, served.loaded, served.export, served.dtype)


def gguf_contents(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """({metadata key: value}, {tensor name: data}) as llama.cpp's `gguf` package reads the file."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise UserError(f"{path}: not a GGUF file llama.cpp can read ({exc})") from None
    fields = {name: field.contents() for name, field in reader.fields.items() if not name.startswith(SKIPPED)}
    return fields, {t.name: np.asarray(t.data) for t in reader.tensors}


def gguf_diffs(trained: Path, served: Path) -> list[str]:
    """What llama.cpp reads otherwise in `served` than in `trained`; none when the files are the same bytes (the
    converter is deterministic), which spares parsing a target vocabulary's arrays twice."""
    if filecmp.cmp(trained, served, shallow=False):
        return []
    (a, ta), (b, tb) = gguf_contents(trained), gguf_contents(served)
    out = [f"{k}: trained {a.get(k, '<missing>')!r}, llama.cpp will read {b.get(k, '<missing>')!r}"
           for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]  # fmt: skip
    out += [f"tensor {name}: not in the export" for name in sorted(set(ta) - set(tb))]
    out += [f"tensor {name}: in the export only" for name in sorted(set(tb) - set(ta))]
    for name in sorted(set(ta) & set(tb)):
        if ta[name].shape != tb[name].shape or not np.array_equal(ta[name], tb[name]):
            out.append(f"tensor {name}: differs from the trained draft's")
    return out


def check_gguf(recipe: Recipe, loaded: LoadedDraft, export: Path, dtype: str) -> Check:
    """`export`'s GGUF against one converted from the checkpoint `loaded` into a temporary directory."""
    fmt = next((f for f in loaded.family.formats.values() if f.draft_file), None)
    if fmt is None:
        return Check(NAME, "skip", f"llama.cpp has no runtime for {loaded.family.title}s")
    served = export / fmt.draft_file
    if not served.is_file():
        return Check(NAME, "skip", f"no {fmt.draft_file} in {export}", "export --format gguf")
    if problems := fmt.unsupported(loaded.draft):
        return Check(NAME, "fail", f"the trained draft cannot run in llama.cpp: {'; '.join(problems)}")
    with tempfile.TemporaryDirectory(prefix="doctor-gguf-") as tmp:
        fresh = write_export(recipe, loaded.path, fmt.name, Path(tmp) / export.name, dtype, force_k=True)
        lines = gguf_diffs(fresh.path / fmt.draft_file, served)
    if lines:
        fix = f"export again from {loaded.path} (`speculators-train export --format {fmt.name} --force`)"
        return Check(NAME, "fail", "; ".join(lines), fix)
    return Check(NAME, "pass", f"{served.name}: every metadata key and tensor as the checkpoint converts now")
