"""Log files tracked by identity: which files a pass reads, how far each has been read, and where rotation moved it.

Kept apart from the commit protocol (`osd/ingest.py`) because rotation is a question of files (names, inodes and
their bytes), while exactly-once is a question of segments and the state file: this module says which bytes of
which file are new, and ingestion stores them. The rules below decide that.

**Which files.** Every `*.jsonl` under the logs directory and its rotated siblings (`*.jsonl.N`, `*.jsonl.*`,
`*.jsonl-*`). Compressed rotated files (`.gz`, `.zst`, `.bz2`, `.xz`, ...) are not read: compress only files a pass
has already finished (logrotate's `delaycompress`). A file reached under two names (a hard or symbolic link) is read
once.

**Files are tracked by identity, not by name**, so rotation neither loses nor repeats a line. A file is its
(st_dev, st_ino) together with its content: state.json keeps, per identity, the consumed offset and line count, the
name it was last read under, and fingerprints (SHA-256) of its first bytes (up to `HEAD_BYTES`) and of the bytes just
before the offset (up to `TAIL_BYTES`). At each pass:

- A known identity whose size reaches its offset and whose fingerprints still match is continued from its offset,
  under whatever name it has now: a file renamed by rotation (`app.jsonl` -> `app.jsonl.1`, or to another
  `*.jsonl` name) has its tail finished and is never read again from the start.
- A known identity that shrank below its offset or whose fingerprints changed was truncated or rewritten in place
  (this also catches a reused inode): its old content is retired and the file is read from the start. Rewritten
  content whose first bytes and whose bytes before the old offset are identical to what was read cannot be told
  from the same file, and is taken as such.
- Content continues across copies: a file whose first bytes and bytes before offset K equal those of retired content
  (a file truncated or gone) or of a file already tracked, up to K, is taken as a copy of it, and is read from K
  only. This is how copytruncate rotation (copy `app.jsonl` to `app.jsonl.1`, then truncate `app.jsonl`) loses
  nothing: the lines written between the last pass and the copy exist only in the copy, and are read from it; and a
  pass that runs between the copy and the truncation does not read the copy again. Only a file whose name is the
  other's or starts with its stem (`app` for `app.jsonl`) followed by `.`, `-` or `_` is compared, so unrelated
  files holding equal lines stay apart.
- Retired content is kept (the newest `RETIRED_KEEP`) so that a copy or a file moved back can be matched later.

A line longer than the ingestion's limit is read in bounded memory (`read_lines`): only its length and its first and
last bytes are kept, which is all the fingerprints need.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from speculators_train.loading import printable
from speculators_train.osd.redact import Redactor

HEAD_BYTES = 4096  # fingerprint of a file's first bytes: what must not change while it is the same file
TAIL_BYTES = 4096  # fingerprint of the bytes just before the committed offset: catches a rewrite with the same start
RETIRED_KEEP = 256  # retired contents (truncated, rewritten or vanished files) kept for matching copies
READ_CHUNK = 1 << 20
COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".zstd", ".lz4", ".lzma", ".lz", ".z", ".zip", ".br", ".7z", ".tgz")
_LOG_NAME = re.compile(r"\.jsonl(?:[.\-].*)?$")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fingerprints(fd: int, offset: int) -> tuple[bytes, bytes]:
    """The bytes the fingerprints of a file consumed up to `offset` cover: its first ones and those before `offset`."""
    head = os.pread(fd, min(offset, HEAD_BYTES), 0)
    tail_start = max(0, offset - TAIL_BYTES)
    return head, os.pread(fd, offset - tail_start, tail_start)


def matches(fd: int, size: int, content: dict[str, Any]) -> bool:
    """The file holds, up to `content`'s offset, the bytes `content` recorded."""
    if size < content["offset"]:
        return False
    head, tail = fingerprints(fd, content["offset"])
    return sha(head) == content["head"] and sha(tail) == content["tail"]


def content(offset: int, lines: int, head: bytes, tail: bytes) -> dict[str, Any]:
    """What a file has been read up to: its offset and line count, and the fingerprints of the bytes consumed."""
    return {"offset": offset, "lines": lines, "head": sha(head[: min(offset, HEAD_BYTES)]), "tail": sha(tail)}


def _stem(name: str) -> str:
    base = name.rsplit("/", 1)[-1]
    return base[: base.index(".jsonl")] if ".jsonl" in base else base


def _derived(name: str, other: str) -> bool:
    base, stem = name.rsplit("/", 1)[-1], _stem(other)
    return base == other.rsplit("/", 1)[-1] or (base.startswith(stem) and base[len(stem) : len(stem) + 1] in ".-_")


def related(name: str, other: str) -> bool:
    """One of the two files may hold a copy of the other's content: the same base name, or one starts with the other's
    stem and a separator (`app.jsonl.1`, `app-2024-01-01.jsonl` and `app_old.jsonl` for `app.jsonl`)."""
    return _derived(name, other) or _derived(other, name)


def _base(name: str) -> str:
    return name.rsplit("/", 1)[-1]


def _separated(base: str) -> set[str]:
    """`base` and each of its prefixes that a separator follows: the stems a name derived from it may start with."""
    return {base, *(base[:i] for i, c in enumerate(base) if c in ".-_")}


class Relatives:
    """A pass's files by the names `related` compares (each under its name now and its name in the state), so each
    file's relatives are looked up, not searched for among every file: a pass stays linear in the number of files."""

    def __init__(self, files: list[LogFile], state: dict[str, Any]) -> None:
        self._by: dict[tuple[str, str], dict[str, int]] = {}
        self._files = files
        for position, f in enumerate(files):
            for name in {f.name, state["files"][f.key]["name"]}:
                self._add(("base", _base(name)), f, position)
                self._add(("stem", _stem(name)), f, position)
                for prefix in _separated(_base(name)):
                    self._add(("prefix", prefix), f, position)

    def _add(self, index: tuple[str, str], f: LogFile, position: int) -> None:
        self._by.setdefault(index, {})[f.key] = position

    def of(self, name: str) -> list[LogFile]:
        """Every file that may be `related` to `name` (a superset: the caller checks), in listing order."""
        found = dict(self._by.get(("base", _base(name)), {}))
        for prefix in _separated(_base(name)):  # files whose stem `name` starts with
            found.update(self._by.get(("stem", prefix), {}))
        found.update(self._by.get(("prefix", _stem(name)), {}))  # files that start with `name`'s stem
        return [self._files[i] for i in sorted(found.values())]


def _count_lines(fh: BinaryIO, start: int, end: int) -> tuple[int, int]:
    """(newlines in bytes start..end of the file, offset just after the last of them; `start` if none)."""
    fh.seek(start)
    count, last, position = 0, start, start
    while position < end and (chunk := fh.read(min(READ_CHUNK, end - position))):
        count += chunk.count(b"\n")
        if (newline := chunk.rfind(b"\n")) >= 0:
            last = position + newline + 1
        position += len(chunk)
    return count, last


@dataclass
class Line:
    text: bytes | None  # without its newline; None for a line over the length limit
    size: int  # bytes consumed, newline included
    first: bytes  # its first HEAD_BYTES bytes and last TAIL_BYTES bytes, for the fingerprints
    last: bytes


def read_lines(fh: BinaryIO, limit: int) -> Iterator[Line]:
    """Each complete line from the file's position, holding at most `limit` bytes of one line in memory."""
    parts: list[bytes] = []
    size, first, last = 0, b"", b""
    while chunk := fh.read(READ_CHUNK):
        start = 0
        while (newline := chunk.find(b"\n", start)) >= 0:
            piece = chunk[start : newline + 1]
            start = newline + 1
            total = size + len(piece)
            if total <= limit + 1:
                raw = b"".join([*parts, piece]) if parts else piece
                yield Line(raw[:-1], total, raw[:HEAD_BYTES], raw[-TAIL_BYTES:])
            else:
                yield Line(None, total, (first + piece)[:HEAD_BYTES], (last + piece)[-TAIL_BYTES:])
            parts, size, first, last = [], 0, b"", b""
        rest = chunk[start:]
        if not rest:
            continue
        if size < HEAD_BYTES:
            first += rest[: HEAD_BYTES - size]
        last = (last + rest)[-TAIL_BYTES:]
        size += len(rest)
        if size <= limit + 1:
            parts.append(rest)
        else:
            parts = []  # over the limit: only its length, first and last bytes are kept


@dataclass
class LogFile:
    path: Path
    name: str  # relative to the logs directory, POSIX
    key: str  # "st_dev:st_ino"
    size: int


def log_files(logs: Path, root: Path, redact: Redactor, notes: list[str]) -> list[LogFile]:
    """Log files under `logs` and their rotated siblings, each identity once; base names before their rotated copies.
    `root` (the ingestion's own directory) is skipped when it lies under the logs."""
    found: dict[str, LogFile] = {}
    own, resolved_logs = root.resolve(), logs.resolve()
    paths = sorted(logs.rglob("*.jsonl*"), key=lambda p: (p.name, p.as_posix()))
    for path in paths:
        if not _LOG_NAME.search(path.name) or path.name.lower().endswith(COMPRESSED):
            continue
        try:
            st = path.stat()
        except OSError:
            continue  # gone since the listing
        resolved = path.resolve()
        if resolved_logs not in resolved.parents:  # a link out of the logs directory: never copied into the store
            name = printable(redact.without_hook(path.relative_to(logs).as_posix()))
            notes.append(f"{name}: a link to a file outside {logs}, not read")
            continue
        if not path.is_file() or resolved == own or own in resolved.parents:
            continue  # our own segments, when the run directory lies under the logs
        key = f"{st.st_dev}:{st.st_ino}"
        # A name reaches every record's origin and the state: a token in a file name is redacted there too.
        # and escape sequences in one are written out, never sent to a terminal
        name = printable(redact.without_hook(path.relative_to(logs).as_posix()))
        found.setdefault(key, LogFile(path, name, key, st.st_size))
    return list(found.values())


def classify(state: dict[str, Any], files: list[LogFile], notes: list[str]) -> None:
    """Known identities still holding what was read are kept; those truncated or rewritten, and those gone, are
    retired; new identities (or a retired one back with its content) get an entry."""
    tracked, retired = state["files"], state["retired"]
    present = {f.key for f in files}
    for key in [k for k in tracked if k not in present]:
        retired.append({**tracked.pop(key), "key": key})
    for f in files:
        entry = tracked.get(f.key)
        back = next((r for r in retired if r.get("key") == f.key), None) if entry is None else None
        with open(f.path, "rb") as fh:
            if entry is not None and not matches(fh.fileno(), f.size, entry):
                notes.append(
                    f"{f.name}: rotated or rewritten in place (its start or size changed); read from the start"
                )
                retired.append({**tracked.pop(f.key), "key": None})
                entry = None
            elif back is not None and matches(fh.fileno(), f.size, back):
                retired.remove(back)
                entry = tracked[f.key] = {k: v for k, v in back.items() if k != "key"}
        if entry is None:
            tracked[f.key] = {"name": f.name, "origin": None, **content(0, 0, b"", b"")}
    del retired[:-RETIRED_KEEP]


def continue_copy(
    state: dict[str, Any],
    fh: BinaryIO,
    size: int,
    f: LogFile,
    entry: dict[str, Any],
    files: list[LogFile],
    notes: list[str],
) -> None:
    """Skip what this file shares with content already read: retired content it is a copy of (copytruncate's copy,
    made before the truncation), or a tracked file it copies (a pass between the copy and the truncation).
    `files`: the pass's files that may be related to this one (`Relatives.of`)."""
    fd = fh.fileno()
    for retired in list(state["retired"]):
        if retired["offset"] > entry["offset"] and related(f.name, retired["name"]) and matches(fd, size, retired):
            state["retired"].remove(retired)
            entry.update(content(retired["offset"], retired["lines"], *fingerprints(fd, retired["offset"])))
            notes.append(
                f"{f.name}: a copy of {retired['name']} as read before; read from its line {retired['lines'] + 1}"
            )
    for other in files:
        theirs = state["files"][other.key]
        if other.key == f.key or not related(f.name, theirs["name"]):
            continue
        upto = min(size, theirs["offset"])
        if upto <= entry["offset"]:
            continue
        try:
            with open(other.path, "rb") as ofh:
                if os.fstat(ofh.fileno()).st_size < upto or fingerprints(ofh.fileno(), upto) != fingerprints(fd, upto):
                    continue
        except OSError:
            continue
        count, offset = _count_lines(fh, entry["offset"], upto)  # a partial copy: up to its last complete line
        if count:
            lines = entry["lines"] + count
            entry.update(content(offset, lines, *fingerprints(fd, offset)))
            notes.append(f"{f.name}: a copy of {theirs['name']}; its first {lines} lines are not read again")
