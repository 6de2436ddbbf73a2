"""Exactly-once ingestion of production logs (JSONL) for online distillation.

    <run dir>/osd/ingest/state.json        the commit point: every tracked file and its consumed offset, the segments
    <run dir>/osd/ingest/segments/NNNNNN.jsonl   one line per log line consumed: a conversation or a quarantined one

**Which files.** Every `*.jsonl` under the logs directory and its rotated siblings (`*.jsonl.N`, `*.jsonl.*`,
`*.jsonl-*`). Compressed rotated files (`.gz`, `.zst`, `.bz2`, `.xz`, ...) are not read: compress only files a pass
has already finished (logrotate's `delaycompress`). A file reached under two names (a hard or symbolic link) is read
once.

**Commits.** A pass reads each file from its committed byte offset, stops at the last complete line (a line still
being written is left for the next pass), and commits every `commit_every` lines (or `commit_bytes` of them): the new
segment file is written and fsynced first, then `state.json` is replaced atomically, naming it together with the new
offsets. A crash before the state lands leaves an unnamed segment, deleted on the next start, and the same lines are
read again; after it lands they are never read again. So each log line ends up in exactly one committed segment,
whatever moment a kill -9 hits.

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

Origins are `name:line`, the name the line was read under and its line number in that file (a renamed or copied
file's numbers continue from the lines counted before). When several contents are read under one name over time (a
new `app.jsonl` after rotation, a truncated file), the second and later are `name#2:line`, `name#3:line`, ... so an
origin names one line for good. A state.json of the older name-keyed format is migrated on load: each entry goes to
the file that now has that name (or a rotated sibling of it) if its first bytes still hash as recorded.

**Hostile lines.** A line longer than `max_line_bytes` is quarantined as `line_too_long` without its text, and read in
bounded memory; JSON nested too deeply to parse and numbers too long to convert are quarantined with their reason
(as is text with lone surrogates, by the record reader). Long lines cost linear time everywhere.

**Redaction** (`osd/redact.py`: the built-in rules and what each removes) runs before anything is written: message
texts, record ids, quarantined raw lines and quarantine reasons.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from speculators_train.data.conversations import Conversation, SkipReport, normalize_record
from speculators_train.errors import UserError
from speculators_train.files import atomic_write_json, to_json
from speculators_train.loading import read_json
from speculators_train.osd.redact import RedactionFailed, Redactor

STATE_VERSION = 2
HEAD_BYTES = 4096  # fingerprint of a file's first bytes: what must not change while it is the same file
TAIL_BYTES = 4096  # fingerprint of the bytes just before the committed offset: catches a rewrite with the same start
RETIRED_KEEP = 256  # retired contents (truncated, rewritten or vanished files) kept for matching copies
MAX_LINE_BYTES = 64 << 20  # longer lines are quarantined without their text
COMMIT_BYTES = 64 << 20  # a batch of big lines is committed at this size, whatever commit_every says
READ_CHUNK = 1 << 20
COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".zstd", ".lz4", ".lzma", ".lz", ".z", ".zip", ".br", ".7z", ".tgz")
_LOG_NAME = re.compile(r"\.jsonl(?:[.\-].*)?$")


@dataclass
class IngestStats:
    records: int = 0
    quarantined: int = 0
    files: int = 0
    pending_bytes: int = 0  # an incomplete last line, left for the next pass
    notes: list[str] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)


def _response_text(response: Any) -> str | None:
    """The assistant text of a logged response: a string, an OpenAI chat completion (`choices[0].message`), a
    completion (`choices[0].text`), or a message object."""
    if isinstance(response, str):
        return response
    if isinstance(response, dict):
        if "choices" in response:
            return _response_text(response["choices"])
        if isinstance(response.get("message"), dict):
            return _response_text(response["message"])
        for key in ("content", "text"):
            if isinstance(response.get(key), str):
                return response[key]
    if isinstance(response, list) and response:
        return _response_text(response[0])
    return None


def to_chat(obj: Any) -> dict[str, Any] | str:
    """A log line as {"messages": [...]} with the response as the last assistant turn, or the reason it is not
    one. Accepted: OpenAI-style {messages, response | choices} (also nested as {request: {messages}, response}),
    and plain {prompt, completion | response}."""
    if not isinstance(obj, dict):
        return "not_an_object"
    request = obj.get("request") if isinstance(obj.get("request"), dict) else obj
    response = next((obj[k] for k in ("response", "choices", "completion", "output") if k in obj), None)
    if "messages" in request:
        messages = request["messages"]
        if not isinstance(messages, list):
            return "messages_not_a_list"
        if not messages:
            return "empty_conversation"
    elif isinstance(request.get("prompt"), str):
        messages = [{"role": "user", "content": request["prompt"]}]
    else:
        return "no_messages_or_prompt"
    if response is None:
        return "no_response"
    text = _response_text(response)
    if text is None:
        return "response_without_text"
    record = {"messages": [*messages, {"role": "assistant", "content": text}]}
    for key in ("id", "request_id"):
        if isinstance(obj.get(key), (str, int)):
            record["id"] = obj[key]
            break
    return record


def parse_line(raw: bytes, origin: str, redact: Redactor) -> tuple[Conversation | None, str | None]:
    """(conversation, None) or (None, the reason it is quarantined). The conversation's texts and id are redacted."""
    try:
        obj = json.loads(raw)
        chat = to_chat(obj)
        if isinstance(chat, str):
            return None, chat
        report = SkipReport()
        conversation = normalize_record(chat, "logs", origin, report)
    except RecursionError:
        return None, "invalid_json: nested too deeply to read"
    except UnicodeDecodeError as exc:
        return None, f"invalid_json: {exc.reason}"
    except ValueError as exc:  # JSONDecodeError, or an integer too long to convert
        return None, f"invalid_json: {exc.msg if isinstance(exc, json.JSONDecodeError) else exc}"
    if conversation is None:
        return None, next(iter(report.counts))
    try:
        messages = tuple({"role": m["role"], "content": redact(m["content"])} for m in conversation.messages)
        return Conversation(redact(conversation.id), messages, origin), None
    except RedactionFailed as exc:
        return None, f"redact_hook_failed: {exc}"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fingerprints(fd: int, offset: int) -> tuple[bytes, bytes]:
    """The bytes the fingerprints of a file consumed up to `offset` cover: its first ones and those before `offset`."""
    head = os.pread(fd, min(offset, HEAD_BYTES), 0)
    tail_start = max(0, offset - TAIL_BYTES)
    return head, os.pread(fd, offset - tail_start, tail_start)


def _matches(fd: int, size: int, content: dict[str, Any]) -> bool:
    """The file holds, up to `content`'s offset, the bytes `content` recorded."""
    if size < content["offset"]:
        return False
    head, tail = _fingerprints(fd, content["offset"])
    return _sha(head) == content["head"] and _sha(tail) == content["tail"]


def _stem(name: str) -> str:
    base = name.rsplit("/", 1)[-1]
    return base[: base.index(".jsonl")] if ".jsonl" in base else base


def _derived(name: str, other: str) -> bool:
    base, stem = name.rsplit("/", 1)[-1], _stem(other)
    return base == other.rsplit("/", 1)[-1] or (base.startswith(stem) and base[len(stem) : len(stem) + 1] in ".-_")


def _related(name: str, other: str) -> bool:
    """One of the two files may hold a copy of the other's content: the same base name, or one starts with the other's
    stem and a separator (`app.jsonl.1`, `app-2024-01-01.jsonl` and `app_old.jsonl` for `app.jsonl`)."""
    return _derived(name, other) or _derived(other, name)


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
class _Line:
    text: bytes | None  # without its newline; None for a line over the length limit
    size: int  # bytes consumed, newline included
    first: bytes  # its first HEAD_BYTES bytes and last TAIL_BYTES bytes, for the fingerprints
    last: bytes


def _read_lines(fh: BinaryIO, limit: int) -> Iterator[_Line]:
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
                yield _Line(raw[:-1], total, raw[:HEAD_BYTES], raw[-TAIL_BYTES:])
            else:
                yield _Line(None, total, (first + piece)[:HEAD_BYTES], (last + piece)[-TAIL_BYTES:])
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
class _File:
    path: Path
    name: str  # relative to the logs directory, POSIX
    key: str  # "st_dev:st_ino"
    size: int


class LogIngestor:
    def __init__(
        self,
        logs: Path,
        root: Path,
        redact: Redactor,
        commit_every: int = 256,
        *,
        max_line_bytes: int = MAX_LINE_BYTES,
        commit_bytes: int = COMMIT_BYTES,
    ) -> None:
        if not logs.is_dir():
            raise UserError(f"--logs {logs}: not a directory")
        self.logs, self.root, self.redact, self.commit_every = logs, root, redact, commit_every
        self.max_line_bytes, self.commit_bytes = max_line_bytes, commit_bytes
        self.segments_dir = root / "segments"
        self.state_path = root / "state.json"
        self.segments_dir.mkdir(parents=True, exist_ok=True)
        self.notes: list[str] = []
        state = read_json(self.state_path, "ingestion state") if self.state_path.is_file() else None
        self.state = self._checked(state) if state is not None else _empty_state()
        self._committed = json.dumps(self.state, sort_keys=True)
        if self.state.get("version") != STATE_VERSION:
            self.state = self._migrated(self.state)
        committed = set(self.state["segments"])
        for orphan in self.segments_dir.glob("*.jsonl*"):  # written by a pass killed before it committed
            if orphan.name not in committed:
                orphan.unlink()

    def _checked(self, state: Any) -> dict[str, Any]:
        """The loaded state, if it has the shape we write (of this format or the name-keyed one before it)."""
        keys = {"files": dict, "segments": list, "records": int, "quarantined": int}
        if not isinstance(state, dict) or any(not isinstance(state.get(k), t) for k, t in keys.items()):
            raise UserError(
                f"{self.state_path}: ingestion state is damaged (expected an object with files, segments, records "
                "and quarantined); move it away to ingest the logs again from the start"
            )
        version = state.get("version")
        shaped = isinstance(state.get("retired"), list) and isinstance(state.get("names"), dict)
        if version is not None and (version != STATE_VERSION or not shaped):
            raise UserError(f"{self.state_path}: ingestion state of an unknown version or damaged ({version!r})")
        return state

    def _migrated(self, old: dict[str, Any]) -> dict[str, Any]:
        """The name-keyed state of earlier versions, keyed by identity: each name goes to the file that now has it, or
        to a rotated sibling of it, whose first bytes still hash as recorded; others are dropped with a note."""
        state = {**_empty_state(), "segments": old["segments"], "records": old["records"]}
        state["quarantined"] = old["quarantined"]
        candidates = self._candidates()
        for name, entry in sorted(old["files"].items()):
            state["names"][name] = 1
            same_name = [f for f in candidates if f.name == name]
            siblings = [f for f in candidates if f.name != name and _related(f.name, name)]
            for f in same_name + siblings:
                if f.key in state["files"] or f.size < entry["offset"]:
                    continue
                with open(f.path, "rb") as fh:
                    head, tail = _fingerprints(fh.fileno(), entry["offset"])
                if _sha(head) == entry.get("head_sha256"):
                    content = {"offset": entry["offset"], "lines": entry["lines"], "head": _sha(head)}
                    origin = name if f.name == name else None
                    state["files"][f.key] = {**content, "tail": _sha(tail), "name": f.name, "origin": origin}
                    break
            else:
                self.notes.append(
                    f"{name}: in the old ingestion state, but no file starts as it did; its state dropped"
                )
        self.notes.append(f"{self.state_path}: migrated from the name-keyed format ({len(old['files'])} files)")
        return state

    def _candidates(self) -> list[_File]:
        """Log files and their rotated siblings, each identity once; base names before their rotated copies."""
        found: dict[str, _File] = {}
        root, logs = self.root.resolve(), self.logs.resolve()
        paths = sorted(self.logs.rglob("*.jsonl*"), key=lambda p: (p.name, p.as_posix()))
        for path in paths:
            if not _LOG_NAME.search(path.name) or path.name.lower().endswith(COMPRESSED):
                continue
            try:
                st = path.stat()
            except OSError:
                continue  # gone since the listing
            resolved = path.resolve()
            if logs not in resolved.parents:  # a link out of the logs directory: never copied into the store
                name = self.redact.without_hook(path.relative_to(self.logs).as_posix())
                self.notes.append(f"{name}: a link to a file outside {self.logs}, not read")
                continue
            if not path.is_file() or resolved == root or root in resolved.parents:
                continue  # our own segments, when the run directory lies under the logs
            key = f"{st.st_dev}:{st.st_ino}"
            # A name reaches every record's origin and the state: a token in a file name is redacted there too.
            name = self.redact.without_hook(path.relative_to(self.logs).as_posix())
            found.setdefault(key, _File(path, name, key, st.st_size))
        return list(found.values())

    def run(self) -> IngestStats:
        """One pass over every log file; commits as it goes."""
        files = self._candidates()  # may add notes (a link out of the logs directory)
        stats = IngestStats(notes=self.notes)
        self.notes = []
        self._classify(files, stats)
        for f in files:
            stats.files += 1
            self._ingest_file(f, files, stats)
        if json.dumps(self.state, sort_keys=True) != self._committed:
            self._commit([])  # offsets moved past blank lines only, files renamed, retired or advanced
        return stats

    def _classify(self, files: list[_File], stats: IngestStats) -> None:
        """Known identities still holding what was read are kept; those truncated or rewritten, and those gone, are
        retired; new identities (or a retired one back with its content) get an entry."""
        tracked, retired = self.state["files"], self.state["retired"]
        present = {f.key for f in files}
        for key in [k for k in tracked if k not in present]:
            retired.append({**tracked.pop(key), "key": key})
        for f in files:
            entry = tracked.get(f.key)
            back = next((r for r in retired if r.get("key") == f.key), None) if entry is None else None
            with open(f.path, "rb") as fh:
                if entry is not None and not _matches(fh.fileno(), f.size, entry):
                    stats.notes.append(
                        f"{f.name}: rotated or rewritten in place (its start or size changed); read from the start"
                    )
                    retired.append({**tracked.pop(f.key), "key": None})
                    entry = None
                elif back is not None and _matches(fh.fileno(), f.size, back):
                    retired.remove(back)
                    entry = tracked[f.key] = {k: v for k, v in back.items() if k != "key"}
            if entry is None:
                tracked[f.key] = {"name": f.name, "origin": None, **_content(0, 0, b"", b"")}
        del retired[:-RETIRED_KEEP]

    def _ingest_file(self, f: _File, files: list[_File], stats: IngestStats) -> None:
        entry = self.state["files"][f.key]
        try:
            fd = os.open(f.path, os.O_RDONLY)
        except OSError:
            return  # gone since the listing: the next pass sees where it went
        with open(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            if f"{st.st_dev}:{st.st_ino}" != f.key or not _matches(fh.fileno(), st.st_size, entry):
                return  # replaced or rewritten since the listing: the next pass sees it as it is then
            self._continue_copy(fh, st.st_size, f, entry, files, stats)
            if entry["name"] != f.name:
                entry["name"], entry["origin"] = f.name, None  # renamed: its next lines are read under the new name
            head, tail = _fingerprints(fh.fileno(), entry["offset"])
            fh.seek(entry["offset"])
            batch: list[dict[str, Any]] = []
            batch_bytes = 0
            for line in _read_lines(fh, self.max_line_bytes):
                if entry["origin"] is None:
                    entry["origin"] = self._origin_name(f.name)
                entry["lines"] += 1
                entry["offset"] += line.size
                if len(head) < HEAD_BYTES:
                    head += line.first[: HEAD_BYTES - len(head)]
                tail = (tail + line.last)[-TAIL_BYTES:]
                origin = f"{entry['origin']}:{entry['lines']}"
                if line.text is None:
                    reason = f"line_too_long: {line.size - 1} bytes, over the limit of {self.max_line_bytes}"
                    batch.append(self._quarantine(origin, reason, "", stats))
                elif line.text.strip():
                    batch.append(self._entry(line.text.strip(), origin, stats))
                    batch_bytes += line.size
                if len(batch) >= self.commit_every or batch_bytes >= self.commit_bytes:
                    entry.update(_content(entry["offset"], entry["lines"], head, tail))
                    self._commit(batch)
                    batch, batch_bytes = [], 0
            entry.update(_content(entry["offset"], entry["lines"], head, tail))
            stats.pending_bytes += max(0, os.fstat(fh.fileno()).st_size - entry["offset"])
            if batch:
                self._commit(batch)

    def _continue_copy(
        self, fh: BinaryIO, size: int, f: _File, entry: dict[str, Any], files: list[_File], stats: IngestStats
    ) -> None:
        """Skip what this file shares with content already read: retired content it is a copy of (copytruncate's copy,
        made before the truncation), or a tracked file it copies (a pass between the copy and the truncation)."""
        fd = fh.fileno()
        for content in list(self.state["retired"]):
            if (
                content["offset"] > entry["offset"]
                and _related(f.name, content["name"])
                and _matches(fd, size, content)
            ):
                self.state["retired"].remove(content)
                entry.update(_content(content["offset"], content["lines"], *_fingerprints(fd, content["offset"])))
                stats.notes.append(
                    f"{f.name}: a copy of {content['name']} as read before; read from its line {content['lines'] + 1}"
                )
        for other in files:
            theirs = self.state["files"][other.key]
            if other.key == f.key or not _related(f.name, theirs["name"]):
                continue
            upto = min(size, theirs["offset"])
            if upto <= entry["offset"]:
                continue
            try:
                with open(other.path, "rb") as ofh:
                    if os.fstat(ofh.fileno()).st_size < upto or _fingerprints(ofh.fileno(), upto) != _fingerprints(
                        fd, upto
                    ):
                        continue
            except OSError:
                continue
            count, offset = _count_lines(fh, entry["offset"], upto)  # a partial copy: up to its last complete line
            if count:
                lines = entry["lines"] + count
                entry.update(_content(offset, lines, *_fingerprints(fd, offset)))
                stats.notes.append(f"{f.name}: a copy of {theirs['name']}; its first {lines} lines are not read again")

    def _origin_name(self, name: str) -> str:
        """`name` for the first content read under it, `name#k` for the k-th: an origin names one line for good."""
        count = self.state["names"].get(name, 0) + 1
        self.state["names"][name] = count
        return name if count == 1 else f"{name}#{count}"

    def _entry(self, line: bytes, origin: str, stats: IngestStats) -> dict[str, Any]:
        conversation, reason = parse_line(line, origin, self.redact)
        if conversation is None:
            return self._quarantine(origin, reason, line.decode("utf-8", errors="replace"), stats)
        stats.records += 1
        return {"origin": origin, "id": conversation.id, "messages": list(conversation.messages)}

    def _quarantine(self, origin: str, reason: str, raw: str, stats: IngestStats) -> dict[str, Any]:
        try:
            stored = {"origin": origin, "quarantined": self.redact(reason), "raw": self.redact(raw)}
        except RedactionFailed as exc:  # the hook cannot redact this line: it is kept without its text
            reason = f"redact_hook_failed: {exc}" if not reason.startswith("redact_hook_failed") else reason
            stored = {"origin": origin, "quarantined": reason, "raw": ""}
        kind = reason.split(":")[0]
        stats.quarantined += 1
        stats.reasons[kind] = stats.reasons.get(kind, 0) + 1
        return stored

    def _commit(self, batch: list[dict[str, Any]]) -> None:
        """Segment first (fsynced), then the state naming it: the state file is the only commit point."""
        state = self.state
        if batch:
            segment = f"{len(state['segments']):06d}.jsonl"
            tmp = self.segments_dir / f"{segment}.tmp"
            with open(tmp, "w") as out:
                out.writelines(to_json(item) + "\n" for item in batch)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.segments_dir / segment)
            quarantined = sum("quarantined" in item for item in batch)
            state = {
                **state,
                "segments": [*state["segments"], segment],
                "records": state["records"] + len(batch) - quarantined,
                "quarantined": state["quarantined"] + quarantined,
            }
        atomic_write_json(self.state_path, state)
        self.state = state
        self._committed = json.dumps(state, sort_keys=True)

    def entries(self) -> Iterator[dict[str, Any]]:
        """Every committed entry, in commit order."""
        for segment in self.state["segments"]:
            with open(self.segments_dir / segment) as fh:
                for line in fh:
                    yield json.loads(line)

    def conversations(self) -> Iterator[Conversation]:
        for item in self.entries():
            if "messages" in item:
                messages = tuple(item["messages"])
                yield Conversation(item["id"], messages, item["origin"])


def _empty_state() -> dict[str, Any]:
    return {
        "version": STATE_VERSION,
        "files": {},  # "st_dev:st_ino" -> {name, origin, offset, lines, head, tail}
        "retired": [],  # content of files truncated, rewritten or gone: {key, name, origin, offset, lines, head, tail}
        "names": {},  # name -> how many contents have been read under it (origins name, name#2, ...)
        "segments": [],
        "records": 0,
        "quarantined": 0,
    }


def _content(offset: int, lines: int, head: bytes, tail: bytes) -> dict[str, Any]:
    """What a file has been read up to: its offset and line count, and the fingerprints of the bytes consumed."""
    return {"offset": offset, "lines": lines, "head": _sha(head[: min(offset, HEAD_BYTES)]), "tail": _sha(tail)}
