"""Exactly-once ingestion of production logs (JSONL) for online distillation.

    <run dir>/osd/ingest/state.json        the commit point: every tracked file and its consumed offset, the segments
    <run dir>/osd/ingest/segments/NNNNNN.jsonl   one line per log line consumed: a conversation or a quarantined one

Which bytes of which file are new, across rotation, is `osd/logfiles.py`'s; what a line means is `osd/records.py`'s;
the state file's shape and the migration of its older format are `osd/ingest_state.py`'s. This module reads the new
lines and commits them.

**Commits.** A pass reads each file from its committed byte offset, stops at the last complete line (a line still
being written is left for the next pass), and commits every `commit_every` lines (or `commit_bytes` of them): the new
segment file is written and fsynced first, then `state.json` is replaced atomically, naming it together with the new
offsets. One batch runs across files, and with more than 4 x `commit_every` files tracked a commit waits for a
quarter as many lines as files: the state names every file, so a pass stays linear in its files. A crash before
the state lands leaves an unnamed segment, deleted on the next start, and the same lines are read again; after it
lands they are never read again. So each log line ends up in exactly one committed segment,
whatever moment a kill -9 hits.

Origins are `name:line`, the name the line was read under and its line number in that file (a renamed or copied
file's numbers continue from the lines counted before). When several contents are read under one name over time (a
new `app.jsonl` after rotation, a truncated file), the second and later are `name#2:line`, `name#3:line`, ... so an
origin names one line for good.

**Hostile lines.** A line longer than `max_line_bytes` is quarantined as `line_too_long` without its text, and read in
bounded memory; other lines that are no conversation are quarantined with their reason (`osd/records.py`). Long
lines cost linear time everywhere.

**Redaction** (`osd/redact.py`: the built-in rules and what each removes) runs before anything is written: message
texts, record ids, quarantined raw lines and quarantine reasons.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speculators_train.data.conversations import Conversation
from speculators_train.errors import UserError
from speculators_train.files import atomic_write_json, to_json
from speculators_train.layout import INGEST_STATE, segment_name, segments_dir
from speculators_train.loading import read_json
from speculators_train.osd.ingest_state import STATE_VERSION, checked, empty_state, migrated
from speculators_train.osd.logfiles import (
    HEAD_BYTES,
    TAIL_BYTES,
    LogFile,
    Relatives,
    classify,
    content,
    continue_copy,
    fingerprints,
    log_files,
    matches,
    read_lines,
)
from speculators_train.osd.records import parse_line
from speculators_train.osd.redact import RedactionFailed, Redactor

MAX_LINE_BYTES = 64 << 20  # longer lines are quarantined without their text
COMMIT_BYTES = 64 << 20  # a batch of big lines is committed at this size, whatever commit_every says


@dataclass
class IngestStats:
    records: int = 0
    quarantined: int = 0
    files: int = 0
    pending_bytes: int = 0  # an incomplete last line, left for the next pass
    notes: list[str] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)


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
        self.segments_dir = segments_dir(root)
        self.state_path = root / INGEST_STATE
        self.segments_dir.mkdir(parents=True, exist_ok=True)
        self.notes: list[str] = []
        self._batch: list[dict[str, Any]] = []  # read, not yet committed: the state's offsets already count it
        self._batch_bytes = 0
        self._commit_lines = commit_every
        state = read_json(self.state_path, "ingestion state") if self.state_path.is_file() else None
        self.state = checked(state, self.state_path) if state is not None else empty_state()
        self._committed = json.dumps(self.state, sort_keys=True)
        if self.state.get("version") != STATE_VERSION:
            self.state = migrated(self.state, self._files(), self.state_path, self.notes)
        committed = set(self.state["segments"])
        for orphan in self.segments_dir.glob("*.jsonl*"):  # written by a pass killed before it committed
            if orphan.name not in committed:
                orphan.unlink()

    def _files(self) -> list[LogFile]:
        return log_files(self.logs, self.root, self.redact, self.notes)

    def run(self) -> IngestStats:
        """One pass over every log file; commits as it goes."""
        files = self._files()  # may add notes (a link out of the logs directory)
        stats = IngestStats(notes=self.notes)
        self.notes = []
        classify(self.state, files, stats.notes)
        relatives = Relatives(files, self.state)
        # One batch runs across files, so a pass over N small files commits N / commit_every times, not N: each
        # commit rewrites the state, which names every file.
        self._batch, self._batch_bytes = [], 0
        # Each commit rewrites the state, which names every file: with many files, commit every quarter as many
        # lines as files, so a pass's commits cost linear time in its lines and files together.
        self._commit_lines = max(self.commit_every, len(self.state["files"]) // 4)
        for f in files:
            stats.files += 1
            self._ingest_file(f, relatives, stats)
        if self._batch or json.dumps(self.state, sort_keys=True) != self._committed:
            self._commit(self._batch)  # and offsets moved past blank lines only, files renamed, retired or advanced
        return stats

    def _ingest_file(self, f: LogFile, relatives: Relatives, stats: IngestStats) -> None:
        entry = self.state["files"][f.key]
        try:
            fd = os.open(f.path, os.O_RDONLY)
        except OSError:
            return  # gone since the listing: the next pass sees where it went
        with open(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            if f"{st.st_dev}:{st.st_ino}" != f.key or not matches(fh.fileno(), st.st_size, entry):
                return  # replaced or rewritten since the listing: the next pass sees it as it is then
            continue_copy(self.state, fh, st.st_size, f, entry, relatives.of(f.name), stats.notes)
            if entry["name"] != f.name:
                entry["name"], entry["origin"] = f.name, None  # renamed: its next lines are read under the new name
            head, tail = fingerprints(fh.fileno(), entry["offset"])
            fh.seek(entry["offset"])
            batch = self._batch
            for line in read_lines(fh, self.max_line_bytes):
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
                    self._batch_bytes += line.size
                if len(batch) >= self._commit_lines or self._batch_bytes >= self.commit_bytes:
                    entry.update(content(entry["offset"], entry["lines"], head, tail))
                    self._commit(batch)
                    batch = self._batch = []
                    self._batch_bytes = 0
            entry.update(content(entry["offset"], entry["lines"], head, tail))
            stats.pending_bytes += max(0, os.fstat(fh.fileno()).st_size - entry["offset"])

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
            segment = segment_name(len(state["segments"]))
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
