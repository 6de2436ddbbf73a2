"""Exactly-once ingestion of production logs (JSONL) for online distillation.

    <run dir>/osd/ingest/state.json        the commit point: per file {offset, lines, head_sha256}, the segment list
    <run dir>/osd/ingest/segments/NNNNNN.jsonl   one line per log line consumed: a conversation or a quarantined one

A pass reads each `*.jsonl` under the logs directory from its committed byte offset, stops at the last complete
line (a line still being written is left for the next pass), and commits every `commit_every` lines: the new
segment file is written and fsynced first, then `state.json` is replaced atomically, naming it together with the
new offsets. A crash before the state lands leaves an unnamed segment, deleted on the next start, and the
same lines are read again; after it lands they are never read again. So each log line ends up in exactly one
committed segment, whatever moment a kill -9 hits.

A file whose first bytes changed (rotated, or rewritten) or that shrank below its offset is read again from the
start, with a note. Redaction (built-in patterns, the recipe's regexes, an optional hook) runs before anything is
written, quarantined lines included.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speculators_train.data.conversations import Conversation, SkipReport, normalize_record
from speculators_train.errors import UserError
from speculators_train.files import atomic_write_json, read_json

HEAD_BYTES = 4096  # a file is the same file while its first bytes (up to this many) are unchanged
BUILTIN_PATTERNS = {
    "email": r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}",
    "api_key": r"\b(?:sk|pk|rk|hf|ghp|gho|xox[abp])[-_][A-Za-z0-9_\-]{16,}\b",
    "bearer": r"(?i)\bbearer\s+[A-Za-z0-9._\-]{16,}",
}


@dataclass
class IngestStats:
    records: int = 0
    quarantined: int = 0
    files: int = 0
    pending_bytes: int = 0  # an incomplete last line, left for the next pass
    notes: list[str] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)


class Redactor:
    """Replaces personal data and secrets before anything is stored: built-in patterns (emails, API keys, bearer
    tokens), the recipe's regexes, then an optional `module:function` hook (str -> str)."""

    def __init__(self, patterns: list[str], builtin: bool = True, hook: str | None = None) -> None:
        compiled = [(f"[{name.upper()}]", re.compile(p)) for name, p in BUILTIN_PATTERNS.items()] if builtin else []
        for n, pattern in enumerate(patterns):
            try:
                compiled.append(("[REDACTED]", re.compile(pattern)))
            except re.error as exc:
                raise UserError(f"osd.redact[{n}]: invalid regex {pattern!r} ({exc})") from None
        self.patterns = compiled
        self.hook = _load_hook(hook) if hook else None

    def __call__(self, text: str) -> str:
        for label, pattern in self.patterns:
            text = pattern.sub(label, text)
        return self.hook(text) if self.hook else text


def _load_hook(spec: str) -> Callable[[str], str]:
    module, _, name = spec.partition(":")
    try:
        hook = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"osd.redact_hook: cannot load {spec!r} ({exc}); expected 'module:function'") from None
    if not callable(hook):
        raise UserError(f"osd.redact_hook: {spec!r} is not callable")
    return hook


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
    """(conversation, None) or (None, the reason it is quarantined)."""
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return None, f"invalid_json: {exc.msg if isinstance(exc, json.JSONDecodeError) else exc.reason}"
    chat = to_chat(obj)
    if isinstance(chat, str):
        return None, chat
    report = SkipReport()
    conversation = normalize_record(chat, "logs", origin, report)
    if conversation is None:
        return None, next(iter(report.counts))
    messages = tuple({"role": m["role"], "content": redact(m["content"])} for m in conversation.messages)
    return Conversation(conversation.id, messages, origin), None


class LogIngestor:
    def __init__(self, logs: Path, root: Path, redact: Redactor, commit_every: int = 256) -> None:
        if not logs.is_dir():
            raise UserError(f"--logs {logs}: not a directory")
        self.logs, self.root, self.redact, self.commit_every = logs, root, redact, commit_every
        self.segments_dir = root / "segments"
        self.state_path = root / "state.json"
        self.segments_dir.mkdir(parents=True, exist_ok=True)
        self.state = read_json(self.state_path, "ingestion state") if self.state_path.is_file() else None
        self.state = self.state or {"files": {}, "segments": [], "records": 0, "quarantined": 0}
        committed = set(self.state["segments"])
        for orphan in self.segments_dir.glob("*.jsonl*"):  # written by a pass killed before it committed
            if orphan.name not in committed:
                orphan.unlink()

    def run(self) -> IngestStats:
        """One pass over every log file; commits as it goes."""
        stats = IngestStats()
        for path in sorted(self.logs.rglob("*.jsonl")):
            stats.files += 1
            self._ingest_file(path, stats)
        return stats

    def _ingest_file(self, path: Path, stats: IngestStats) -> None:
        name = path.relative_to(self.logs).as_posix()
        with open(path, "rb") as fh:
            head = fh.read(HEAD_BYTES)
            entry = self.state["files"].get(name)
            size = os.fstat(fh.fileno()).st_size
            if entry is not None and (size < entry["offset"] or not _same_head(head, entry)):
                stats.notes.append(f"{name}: rotated or rewritten (its start or size changed); read from the start")
                entry = None
            entry = dict(entry or {"offset": 0, "lines": 0})
            fh.seek(entry["offset"])
            batch: list[dict[str, Any]] = []
            for raw, end in _complete_lines(fh, entry["offset"]):
                entry["lines"] += 1
                entry["offset"] = end
                line = raw.strip()
                if line:
                    batch.append(self._entry(line, f"{name}:{entry['lines']}", stats))
                if len(batch) >= self.commit_every:
                    self._commit(name, entry, head, batch)
                    batch = []
            stats.pending_bytes += size - entry["offset"]
            if batch or self.state["files"].get(name) != {**entry, "head_sha256": _head_hash(head, entry)}:
                self._commit(name, entry, head, batch)  # also offsets moved past blank lines only

    def _entry(self, line: bytes, origin: str, stats: IngestStats) -> dict[str, Any]:
        conversation, reason = parse_line(line, origin, self.redact)
        if conversation is None:
            stats.quarantined += 1
            stats.reasons[reason.split(":")[0]] = stats.reasons.get(reason.split(":")[0], 0) + 1
            text = self.redact(line.decode("utf-8", errors="replace"))
            return {"origin": origin, "quarantined": reason, "raw": text}
        stats.records += 1
        return {"origin": origin, "id": conversation.id, "messages": list(conversation.messages)}

    def _commit(self, name: str, entry: dict[str, Any], head: bytes, batch: list[dict[str, Any]]) -> None:
        """Segment first (fsynced), then the state naming it: the state file is the only commit point."""
        state = json.loads(json.dumps(self.state))
        if batch:
            segment = f"{len(state['segments']):06d}.jsonl"
            tmp = self.segments_dir / f"{segment}.tmp"
            with open(tmp, "w") as out:
                out.writelines(json.dumps(item) + "\n" for item in batch)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.segments_dir / segment)
            state["segments"].append(segment)
            quarantined = sum("quarantined" in item for item in batch)
            state["records"] += len(batch) - quarantined
            state["quarantined"] += quarantined
        state["files"][name] = {**entry, "head_sha256": _head_hash(head, entry)}
        atomic_write_json(self.state_path, state)
        self.state = state

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


def _head_hash(head: bytes, entry: dict[str, Any]) -> str:
    """Hash of the file's first bytes that were already consumed (at most HEAD_BYTES): what must not change."""
    return hashlib.sha256(head[: min(entry["offset"], HEAD_BYTES)]).hexdigest()


def _same_head(head: bytes, entry: dict[str, Any]) -> bool:
    return _head_hash(head, entry) == entry.get("head_sha256")


def _complete_lines(fh, offset: int) -> Iterator[tuple[bytes, int]]:
    """(line without its newline, byte offset after it) for each line that ends in a newline."""
    for raw in fh:
        if not raw.endswith(b"\n"):
            return  # still being written: the next pass reads it whole
        offset += len(raw)
        yield raw[:-1], offset
