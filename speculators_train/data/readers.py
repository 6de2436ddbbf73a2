"""Read raw records from JSON arrays (with recovery of cut-off files), JSONL, columnar files and hub datasets.

Every reader yields `(record, origin)` where origin is `file:line` (or `dataset#index`), so each skip and
error can name the exact place.

A JSON or JSONL file is decoded as UTF-8 with a leading byte-order mark dropped and each invalid byte kept as a lone
surrogate (Python's `surrogateescape`), so one bad byte costs one record, not the file: the record holding it is
skipped as `invalid_utf8` with its line and column, in JSONL and in a JSON array alike. Only a bad byte between
records of a JSON array (where no record can be cut out around it) refuses the file, by line and column.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from speculators_train.data.conversations import SkipReport
from speculators_train.errors import UserError
from speculators_train.loading import describe, reading

Record = tuple[Any, str]
_SEPARATOR = re.compile(r"[\s,]*")
_WHITESPACE = re.compile(r"\s*")
_INVALID_BYTE = re.compile("[\udc80-\udcff]")  # surrogateescape decodes an invalid byte 0xNN to U+DCNN
_BRACKET_OR_QUOTE = re.compile(r'[\[\]{}"]')
_STRING_REST = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*"', re.S)  # from after an opening quote through the closing one
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?")
COLUMNAR = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
_END = object()


def _invalid_byte(text: str, index: int) -> str:
    """`byte 0xNN at column C` for the invalid byte decoded to `text[index]`; C counts bytes from the line start."""
    line_start = text.rfind("\n", 0, index) + 1
    column = len(text[line_start:index].encode("utf-8", "surrogateescape")) + 1
    return f"byte {ord(text[index]) - 0xDC00:#04x} at column {column}"


def _value_end(text: str, pos: int) -> int | None:
    """Where the JSON value starting at `pos` ends, found without recursion (for a value the parser gave up on):
    brackets are counted outside strings. None if the text ends first."""
    if text[pos] not in "[{":
        number = _NUMBER.match(text, pos)
        return number.end() if number else None
    depth = 0
    while (mark := _BRACKET_OR_QUOTE.search(text, pos)) is not None:
        pos = mark.end()
        if mark.group() == '"':
            rest = _STRING_REST.match(text, pos)
            if rest is None:
                return None
            pos = rest.end()
        elif mark.group() in "[{":
            depth += 1
        else:
            depth -= 1
            if depth == 0:
                return pos
    return None


def read_json_array(text: str, report: SkipReport, label: str) -> Iterator[Record]:
    """Decode a top-level JSON array one element at a time.

    A file cut off mid-record (no closing `]`) keeps every complete record and notes the cut; a broken
    record inside a file that does close is an error, since skipping it would silently drop the rest. A record whose
    end is still known (nested too deep for the parser, an integer past Python's 4,300-digit limit, an invalid byte
    inside a string) is skipped by its line, and reading goes on after it.
    """
    decoder = json.JSONDecoder()
    has_invalid = _INVALID_BYTE.search(text) is not None
    pos, line, line_pos = text.index("[") + 1, 1, 0
    count = 0
    while True:
        pos = _SEPARATOR.match(text, pos).end()
        line += text.count("\n", line_pos, pos)
        line_pos = pos
        if pos >= len(text):
            report.notes.append(f"{label}: JSON array has no closing ']' after {count} records")
            return
        if text[pos] == "]":
            after = _WHITESPACE.match(text, pos + 1).end()
            if after < len(text):
                at = text.count("\n", 0, after) + 1
                raise UserError(f"{label}:{at}: data after the JSON array's closing ']' (two arrays joined?)")
            return
        where = f"{label}:{line}"
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            _broken_record(text, exc, report, label, line, count)
            return
        except (RecursionError, ValueError) as exc:  # ValueError: an integer past the digit limit
            end = _value_end(text, pos)
            if end is None:
                _broken_record(text, None, report, label, line, count)
                return
            report.skip("nested_too_deeply" if isinstance(exc, RecursionError) else "number_too_long", where)
            pos = end
            continue
        bad = _INVALID_BYTE.search(text, pos, end) if has_invalid else None
        if bad is not None:
            bad_line = line + text.count("\n", pos, bad.start())
            report.skip("invalid_utf8", f"{where} (line {bad_line}: {_invalid_byte(text, bad.start())})")
        else:
            count += 1
            yield obj, where
        pos = end


def _broken_record(
    text: str, exc: json.JSONDecodeError | None, report: SkipReport, label: str, line: int, count: int
) -> None:
    """A record that cannot be read to its end: the file was cut off (note it; the records before it stand), or, in
    a file that closes, it is broken (refuse the file: skipping would silently drop the records after it)."""
    if exc is not None and text.rstrip().endswith("]"):
        err_line = text.count("\n", 0, exc.pos) + 1
        if _INVALID_BYTE.match(text, exc.pos):
            raise UserError(f"{label}:{err_line}: not valid UTF-8 in record {count} ({_invalid_byte(text, exc.pos)})")
        raise UserError(f"{label}:{err_line}: invalid JSON in record {count}: {exc.msg}")
    size = len(text.encode("utf-8", "surrogateescape"))
    report.notes.append(
        f"{label}: file is cut off at line {line} (byte {size}); kept the {count} complete records before it"
    )
    report.skip("truncated_tail", f"{label}:{line}")


def read_jsonl(text: str, report: SkipReport, label: str) -> Iterator[Record]:
    """One JSON object per line; a line that cannot be read is skipped and counted with its file and line number."""
    has_invalid = _INVALID_BYTE.search(text) is not None
    lines = text.split("\n")
    for number, raw in enumerate(lines, start=1):
        # Each file joined into this one (`cat a.jsonl b.jsonl`) brings its byte-order mark; JSON allows none.
        raw = raw.removeprefix("\ufeff")
        if not raw.strip():
            continue
        where = f"{label}:{number}"
        bad = _INVALID_BYTE.search(raw) if has_invalid else None
        if bad is not None:
            report.skip("invalid_utf8", f"{where} ({_invalid_byte(raw, bad.start())})")
            continue
        try:
            obj = json.loads(raw)
        except RecursionError:
            report.skip("nested_too_deeply", where)
            continue
        except json.JSONDecodeError as exc:
            last = number == len(lines) and not text.endswith("\n")
            reason = "truncated_last_line" if last else "corrupt_json_line"
            report.skip(reason, f"{where} ({exc.msg} at column {exc.colno})")
            continue
        except ValueError:  # valid JSON, but Python refuses to read an integer of more than 4,300 digits
            report.skip("number_too_long", where)
            continue
        yield obj, where


def read_file(path: Path, report: SkipReport, label: str | None = None) -> Iterator[Record]:
    """Pick the reader from the content: `[` starts a JSON array, `{` JSONL; parquet/arrow/csv via `datasets`.

    `label` names the file in messages (the path as the user wrote it); default the path itself.
    """
    label = label or str(path)
    if path.is_fifo() or path.is_char_device() or path.is_block_device() or path.is_socket():
        raise UserError(f"{label}: a pipe, socket or device, not a file (reading it could wait forever)")
    if path.suffix in COLUMNAR:
        yield from read_datasets(COLUMNAR[path.suffix], None, "train", label=label, data_files=str(path))
        return
    with reading(label, "data file"):
        text = path.read_bytes().decode("utf-8-sig", errors="surrogateescape")
    start = _WHITESPACE.match(text).end()
    head = text[start : start + 1]
    if not head:
        report.notes.append(f"{label}: file is empty")
    elif head == "[":
        yield from read_json_array(text, report, label)
    elif head == "{":
        yield from read_jsonl(text, report, label)
    else:
        shown = text[:16].encode("utf-8", "surrogateescape")  # as bytes: binary files (gzip, PNG) are told apart
        raise UserError(f"{label}: expected a JSON array or JSONL records, file starts with {shown!r}")


@contextlib.contextmanager
def _datasets_errors(label: str, what: str) -> Iterator[None]:
    """Any failure inside `datasets` as one line naming the file or dataset. `datasets` wraps the real failure (a
    CSV parse error) in a generic "error while generating the dataset": the message is the innermost cause's."""
    try:
        yield
    except Exception as exc:  # datasets and its backends (arrow, pandas, fsspec) raise many types
        while exc.__cause__ is not None:
            exc = exc.__cause__
        raise UserError(f"{label}: {what}: {describe(exc)}") from None


def read_datasets(
    name: str, subset: str | None, split: str, streaming: bool = False, label: str | None = None, **kwargs: Any
) -> Iterator[Record]:
    """A `datasets` hub id or builder (parquet/csv/json) with files; records are plain dicts.

    A failure while loading or iterating (a damaged file, no network) is one error naming the file or dataset."""
    import datasets

    label = label or name
    what = f"{name} file" if "data_files" in kwargs else f"dataset split {split!r}"
    with _datasets_errors(label, what):
        records = iter(datasets.load_dataset(name, subset, split=split, streaming=streaming, **kwargs))
    for index in itertools.count():
        with _datasets_errors(label, what):
            record = next(records, _END)
        if record is _END:
            return
        yield record, f"{label}[{split}]#{index}"
