"""Read raw records from JSON arrays (with recovery of cut-off files), JSONL, columnar files and hub datasets.

Every reader yields `(record, origin)` where origin is `file:line` (or `dataset#index`), so each skip and
error can name the exact place.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from speculators_train.data.conversations import SkipReport
from speculators_train.errors import UserError

Record = tuple[Any, str]
_SEPARATOR = re.compile(r"[\s,]*")
COLUMNAR = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}


def read_json_array(path: Path, text: str, report: SkipReport, label: str) -> Iterator[Record]:
    """Decode a top-level JSON array one element at a time.

    A file cut off mid-record (no closing `]`) keeps every complete record and notes the cut; a broken
    record inside a file that does close is an error, since skipping it would silently drop the rest.
    """
    decoder = json.JSONDecoder()
    pos, line, line_pos = text.index("[") + 1, 1, 0
    count = 0
    while True:
        pos = _SEPARATOR.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            if pos >= len(text):
                report.notes.append(f"{label}: JSON array has no closing ']' after {count} records")
            return
        line += text.count("\n", line_pos, pos)
        line_pos = pos
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            if text.rstrip().endswith("]"):
                err_line = text.count("\n", 0, exc.pos) + 1
                raise UserError(f"{label}:{err_line}: invalid JSON in record {count}: {exc.msg}") from None
            report.notes.append(
                f"{label}: file is cut off at line {line} (byte {len(text.encode())}); "
                f"kept the {count} complete records before it"
            )
            report.skip("truncated_tail", f"{label}:{line}")
            return
        count += 1
        yield obj, f"{label}:{line}"


def read_jsonl(path: Path, text: str, report: SkipReport, label: str) -> Iterator[Record]:
    """One JSON object per line; a corrupt line is skipped and counted with its file and line number."""
    lines = text.split("\n")
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            last = number == len(lines) and not text.endswith("\n")
            reason = "truncated_last_line" if last else "corrupt_json_line"
            report.skip(reason, f"{label}:{number} ({exc.msg} at column {exc.colno})")
            continue
        yield obj, f"{label}:{number}"


def read_file(path: Path, report: SkipReport, label: str | None = None) -> Iterator[Record]:
    """Pick the reader from the content: `[` starts a JSON array, `{` JSONL; parquet/arrow/csv via `datasets`.

    `label` names the file in messages (the path as the user wrote it); default the path itself.
    """
    label = label or str(path)
    if path.suffix in COLUMNAR:
        yield from read_datasets(COLUMNAR[path.suffix], None, "train", report, data_files=str(path))
        return
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{label}: not UTF-8 text (byte {exc.start}); expected JSON or JSONL") from None
    head = text.lstrip()[:1]
    if not head:
        report.notes.append(f"{label}: file is empty")
    elif head == "[":
        yield from read_json_array(path, text, report, label)
    elif head == "{":
        yield from read_jsonl(path, text, report, label)
    else:
        raise UserError(f"{label}: expected a JSON array or JSONL records, file starts with {head!r}")


def read_datasets(
    name: str, subset: str | None, split: str, report: SkipReport, streaming: bool = False, **kwargs: Any
) -> Iterator[Record]:
    """A `datasets` hub id or builder (parquet/csv/json) with files; records are plain dicts."""
    import datasets

    try:
        dataset = datasets.load_dataset(name, subset, split=split, streaming=streaming, **kwargs)
    except Exception as exc:  # datasets raises many types (FileNotFound, ConnectionError, ValueError)
        raise UserError(f"could not load dataset {name!r} (split {split!r}): {exc}") from None
    label = kwargs.get("data_files", name)
    for index, record in enumerate(dataset):
        yield record, f"{label}[{split}]#{index}"
