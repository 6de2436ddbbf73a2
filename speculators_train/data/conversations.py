"""One normalised conversation type for every source format, and a report of everything skipped."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "model": "assistant",
}
MAX_EXAMPLES = 5


@dataclass(frozen=True)
class Conversation:
    """A record after normalisation: `id` is `<source>:<record id>` and decides the held-out split."""

    id: str
    messages: tuple[dict[str, str], ...]
    origin: str  # file:line or dataset#index, for messages about this record


@dataclass
class SkipReport:
    """Counts of skipped records by reason, with a few `where` examples each, plus notes (e.g. cut-off files)."""

    counts: Counter = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def skip(self, reason: str, where: str) -> None:
        self.counts[reason] += 1
        examples = self.examples.setdefault(reason, [])
        if len(examples) < MAX_EXAMPLES:
            examples.append(where)

    def merge(self, other: SkipReport) -> None:
        for reason, count in other.counts.items():
            self.counts[reason] += count
            examples = self.examples.setdefault(reason, [])
            examples.extend(other.examples.get(reason, [])[: MAX_EXAMPLES - len(examples)])
        self.notes.extend(note for note in other.notes if note not in self.notes)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def to_dict(self) -> dict[str, Any]:
        return {"counts": dict(sorted(self.counts.items())), "examples": self.examples, "notes": self.notes}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SkipReport:
        return cls(Counter(data.get("counts", {})), dict(data.get("examples", {})), list(data.get("notes", [])))

    def lines(self) -> list[str]:
        out = [f"note: {note}" for note in self.notes]
        for reason, count in sorted(self.counts.items()):
            out.append(f"skipped {count}: {reason} (e.g. {'; '.join(self.examples.get(reason, [])[:2])})")
        return out


def _content_text(content: Any) -> str | None:
    """Plain text of a message: a string, or OpenAI-style content parts of type text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        texts = [p.get("text") for p in content if p.get("type", "text") == "text"]
        if all(isinstance(t, str) for t in texts):
            return "".join(texts)
    return None


def normalize_record(obj: Any, source: str, origin: str, report: SkipReport) -> Conversation | None:
    """ShareGPT (`conversations` of from/value) or OpenAI/UltraChat (`messages` of role/content) -> Conversation."""
    if not isinstance(obj, dict):
        report.skip("not_an_object", origin)
        return None
    if "conversations" in obj:
        turns, role_key, text_key = obj["conversations"], "from", "value"
    elif "messages" in obj:
        turns, role_key, text_key = obj["messages"], "role", "content"
    else:
        report.skip("no_conversations_or_messages_field", f"{origin} keys={sorted(obj)[:6]}")
        return None
    if not isinstance(turns, list):
        report.skip("bad_field", f"{origin} field=conversations/messages is {type(turns).__name__}")
        return None
    if not turns:
        report.skip("empty_conversation", origin)
        return None
    messages = []
    for n, turn in enumerate(turns):
        if not isinstance(turn, dict):
            report.skip("bad_field", f"{origin} turn {n} is {type(turn).__name__}")
            return None
        raw_role = turn.get(role_key, turn.get("role", turn.get("from")))
        role = ROLES.get(str(raw_role).lower()) if raw_role is not None else None
        if role is None:
            report.skip("unknown_role", f"{origin} turn {n} role={raw_role!r}")
            return None
        text = _content_text(turn.get(text_key, turn.get("content", turn.get("value"))))
        if text is None:
            report.skip("bad_field", f"{origin} turn {n} field={text_key} is not text")
            return None
        messages.append({"role": role, "content": text})
    if not any(m["role"] == "assistant" for m in messages):
        report.skip("no_assistant_turn", origin)
        return None
    id_keys = ("id", "prompt_id", "conversation_id")
    record_id = next((obj[k] for k in id_keys if isinstance(obj.get(k), (str, int))), None)
    if record_id is None:
        record_id = hashlib.sha1(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:16]
    return Conversation(id=f"{source}:{record_id}", messages=tuple(messages), origin=origin)
