"""`doctor --prompts FILE`: real requests against the training data. FILE holds OpenAI chat-completions request
bodies (JSONL or a JSON array): `messages`, and optionally `chat_template_kwargs` and `reasoning_effort`, which a
server passes to the chat template. A system prompt the training data never had and a request rendered otherwise
than the training data was (reasoning on in one, off in the other) are named; the requests' prompts then stand in
for the eval suite's in the acceptance checks. Prompt texts are never quoted in the report: a system prompt is
named by a short hash."""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speculators_train.data.chat import Chat, template_arguments
from speculators_train.data.conversations import Conversation, SkipReport, normalize_record
from speculators_train.data.readers import read_file
from speculators_train.doctor.report import Check
from speculators_train.errors import UserError

# Closes a request's messages into a record the data normaliser takes (it wants a reply); dropped again after
REPLY = {"role": "assistant", "content": "(reply)"}


@dataclass
class Request:
    messages: list[dict[str, Any]]  # normalised, up to the reply the server writes
    kwargs: dict[str, Any] = field(default_factory=dict)  # what the server passes to the chat template
    origin: str = ""


def read_requests(path: Path) -> tuple[list[Request], SkipReport]:
    """The usable requests of `path`, and the counted skips (unknown roles, no messages, bad fields)."""
    report = SkipReport()
    out = []
    for obj, origin in read_file(path, report):
        messages = obj.get("messages") if isinstance(obj, dict) else None
        closed = {**obj, "messages": [*messages, REPLY]} if isinstance(messages, list) else obj
        conv = normalize_record(closed, "requests", origin, report)
        if conv is None:
            continue
        kwargs = obj.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            report.skip("bad_field", f"{origin} field=chat_template_kwargs is {type(kwargs).__name__}")
            continue
        if taken := sorted(set(kwargs) & template_arguments()):  # apply_chat_template's own: no template variable
            report.skip("bad_field", f"{origin} field=chat_template_kwargs.{taken[0]} is apply_chat_template's own")
            continue
        if "reasoning_effort" in obj:  # gpt-oss-style templates read it as a template variable
            kwargs = {**kwargs, "reasoning_effort": obj["reasoning_effort"]}
        out.append(Request([dict(m) for m in conv.messages[:-1]], kwargs, origin))
    if not out:
        raise UserError(f"{path}: no usable chat request ({'; '.join(report.lines()) or 'no records'})")
    return out, report


def _system(messages: Any) -> str | None:
    return next((m.get("content") for m in messages if m.get("role") == "system"), None)


def _named(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:12]


def check_system_prompt(requests: list[Request], train: list[Conversation]) -> Check:
    """Requests whose system prompt no training conversation had: the draft never saw the prefix it drafts after."""
    name = "system prompt: training against serving"
    trained = Counter(_system(c.messages) for c in train)
    unseen = Counter(s for s in map(_system, (r.messages for r in requests)) if s is not None and s not in trained)
    with_one = sum(n for s, n in trained.items() if s is not None)
    distinct = sum(1 for s in trained if s is not None)
    detail = f"{with_one} of {len(train)} training conversations have a system prompt ({distinct} distinct)"
    if not unseen:
        return Check(name, "pass", f"{detail}; every request's system prompt is among them, or it has none")
    shown = ", ".join(f"{_named(s)} x{n}" for s, n in unseen.most_common(3))
    detail += f"; {sum(unseen.values())} of {len(requests)} requests carry one the training data never had ({shown})"
    fix = "add conversations with the served system prompt to the data mix (with data.regenerate the target writes "
    fix += "their replies) and retrain: the draft drafts after a prefix it never saw"
    return Check(name, "warn", detail, fix)


def check_rendering(requests: list[Request], tokenizer: Any, trained_kwargs: dict[str, Any]) -> Check:
    """Each request rendered by the target's chat template with its own `chat_template_kwargs` against the same
    messages rendered with the training data's (`data.chat_template_kwargs`): only settings the template reads
    count, so reasoning switched on in one and off in the other shows, an unused key does not."""
    name = "request rendering: training against serving"
    trained = Chat(tokenizer, trained_kwargs)
    differ = Counter()
    for r in requests:
        if Chat(tokenizer, r.kwargs).prompt_ids(r.messages) != trained.prompt_ids(r.messages):
            differ[repr(dict(sorted(r.kwargs.items())))] += 1
    if not differ:
        return Check(name, "pass", f"{len(requests)} requests render as the training data did ({trained_kwargs})")
    shown = ", ".join(f"{kwargs} x{n}" for kwargs, n in differ.most_common(3))
    detail = f"{sum(differ.values())} of {len(requests)} requests render otherwise than the training data "
    detail += f"(data.chat_template_kwargs {trained_kwargs}): {shown}"
    fix = "train with the served settings (data.chat_template_kwargs, e.g. enable_thinking as the server runs it) "
    fix += "and regenerate the states, or serve with the trained ones"
    return Check(name, "fail", detail, fix)
