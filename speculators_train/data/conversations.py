"""One normalised conversation type for every source format, and a report of everything skipped."""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
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
    # role, content (text), `reasoning` on replies that carry it, `parts` (text and image parts in order) on turns
    # with images
    messages: tuple[dict[str, Any], ...]
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

    def nothing_left(self, where: str, split: str, records: int) -> str:
        """The refusal for a split whose `records` records gave no sample: why each was skipped."""
        why = "; ".join(self.lines()) or "no skip was recorded"
        hint = ""
        if self.counts.get("chat_template_error"):
            hint = " (the target's chat template refused them: check data.chat_template_kwargs and the roles)"
        return f"{where}: the {split} split's {records} records gave no sample{hint}: {why}"

    def lines(self) -> list[str]:
        out = [f"note: {note}" for note in self.notes]
        for reason, count in sorted(self.counts.items()):
            out.append(f"skipped {count}: {reason} (e.g. {'; '.join(self.examples.get(reason, [])[:2])})")
        return out


# A str holds a surrogate code point only when it came from a lone `\ud800`-style JSON escape (a valid pair decodes to
# one character) or from an invalid byte: such text cannot be encoded as UTF-8, so no tokenizer or file can take it.
_SURROGATE = re.compile("[\ud800-\udfff]")
ID_KEYS = ("id", "prompt_id", "conversation_id")


def _image_ref(part: dict[str, Any]) -> str | None:
    """The image a content part points at (OpenAI `image_url` {url} or a bare string; transformers' `image` /
    `url`), None when the part is not an image or names none."""
    kind = part.get("type")
    if kind == "image_url":
        value = part.get("image_url")
        value = value.get("url") if isinstance(value, dict) else value
    elif kind == "image":
        value = part.get("image", part.get("url"))
    else:
        return None
    return value if isinstance(value, str) and value.strip() else None


def _content_text(content: Any) -> tuple[str | None, list[dict[str, str]] | None, str]:
    """A message's plain text, its parts when it has images, or None and the skip reason: a string, or OpenAI-style
    content parts.

    Text parts are joined (what a text-only target reads); image parts are kept in order beside the text (what a
    multimodal target's processor reads); other parts (audio, images that name nothing) are dropped. A turn left
    with neither text nor an image is `non_text_content`: training on it would teach replies to an input the draft
    never sees (an empty user turn answered at length)."""
    if isinstance(content, str):
        return content, None, ""
    if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
        return None, None, "bad_field"
    texts = [p.get("text") for p in content if p.get("type", "text") == "text"]
    if not all(isinstance(t, str) for t in texts):
        return None, None, "bad_field"
    text = "".join(texts)
    parts: list[dict[str, str]] = []
    for part in content:
        if part.get("type", "text") == "text":
            parts.append({"type": "text", "text": part["text"]})
        elif (ref := _image_ref(part)) is not None:
            parts.append({"type": "image", "image": ref})
    images = any(p["type"] == "image" for p in parts)
    if len(texts) < len(content) and not text.strip() and not images:
        return None, None, "non_text_content"
    return text, parts if images else None, ""


def has_images(message: dict[str, Any]) -> bool:
    """Whether a normalised message carries image parts (its `parts`; `content` is its text alone)."""
    return "parts" in message


# Where OpenAI-style records keep a reply's reasoning, and chat templates read it (Qwen3 and DeepSeek
# `reasoning_content`, vLLM's `reasoning`, gpt-oss's `thinking`); a normalised message holds it as `reasoning`.
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")


def _reasoning(turn: dict[str, Any]) -> str | None:
    """A reply's reasoning text, if the record carries one as a string (anything else is not reasoning we can use)."""
    for key in REASONING_FIELDS:
        value = turn.get(key)
        if isinstance(value, str) and value.strip():
            return value
    return None


def _record_id(obj: dict[str, Any], messages: list[dict[str, str]]) -> str | None:
    """The record's own id, typed so that `7` and `"7"` stay two records; a hash of the messages if it has none.

    A string id is used as written (so its held-out hash is what it always was); an integer id gets a `:int` suffix.
    An empty string or a boolean names nothing and is passed over. None if the id holds a lone surrogate."""
    for key in ID_KEYS:
        value = obj.get(key)
        if isinstance(value, str) and value.strip():
            return None if _SURROGATE.search(value) else value
        if isinstance(value, int) and not isinstance(value, bool):
            return f"{value}:int"
    return hashlib.sha1(json.dumps(messages, sort_keys=True).encode()).hexdigest()[:16]


def _resolved(part: dict[str, str], base: Path) -> dict[str, str]:
    """An image part whose reference is a relative file path, made absolute against the data file's folder (where
    the user keeps the images beside it); URLs, data URLs and absolute paths as they are."""
    ref = part.get("image")
    if ref is None or ref.startswith(("data:", "http://", "https://", "file://")) or Path(ref).is_absolute():
        return part
    return {**part, "image": str(base / ref)}


def normalize_record(
    obj: Any, source: str, origin: str, report: SkipReport, base: Path | None = None
) -> Conversation | None:
    """ShareGPT (`conversations` of from/value) or OpenAI/UltraChat (`messages` of role/content) -> Conversation.
    `base`: the data file's folder, against which relative image paths are read."""
    if not isinstance(obj, dict):
        report.skip("not_an_object", f"{origin} ({type(obj).__name__})")
        return None
    if "conversations" in obj:
        turns, role_key, text_key = obj["conversations"], "from", "value"
    elif "messages" in obj:
        turns, role_key, text_key = obj["messages"], "role", "content"
    else:
        keys = [str(k)[:40] for k in sorted(obj)[:6]]  # a hostile file's keys may be megabytes long
        report.skip("no_conversations_or_messages_field", f"{origin} keys={keys}")
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
        role = ROLES.get(raw_role.lower()) if isinstance(raw_role, str) else None
        if role is None:
            # Only a string is quoted: a nested value's repr could be huge or too deep to print.
            shown = repr(raw_role[:40]) if isinstance(raw_role, str) else type(raw_role).__name__
            report.skip("unknown_role", f"{origin} turn {n} role={shown}")
            return None
        text, parts, reason = _content_text(turn.get(text_key, turn.get("content", turn.get("value"))))
        if text is None:
            what = "has only non-text parts" if reason == "non_text_content" else f"field={text_key} is not text"
            report.skip(reason, f"{origin} turn {n} {what}")
            return None
        if parts is not None and role == "assistant":  # its image tokens would be trained on, with no pixels read
            report.skip("image_in_reply", f"{origin} turn {n}")
            return None
        reasoning = _reasoning(turn) if role == "assistant" else None
        refs = [p["image"] for p in parts or () if p["type"] == "image"]
        if _SURROGATE.search(text) or (reasoning and _SURROGATE.search(reasoning)) or any(map(_SURROGATE.search, refs)):
            report.skip("lone_surrogate", f"{origin} turn {n}")
            return None
        message = {"role": role, "content": text, **({"reasoning": reasoning} if reasoning else {})}
        messages.append({**message, "parts": parts} if parts is not None else message)
    if not any(m["role"] == "assistant" for m in messages):
        report.skip("no_assistant_turn", origin)
        return None
    rid = _record_id(obj, messages)  # before paths are resolved: a moved data folder keeps its ids and split
    if rid is None:
        report.skip("lone_surrogate", f"{origin} id")
        return None
    if base is not None:
        messages = [{**m, "parts": [_resolved(p, base) for p in m["parts"]]} if has_images(m) else m for m in messages]
    return Conversation(id=f"{source}:{rid}", messages=tuple(messages), origin=origin)
