"""Log records: one production log line read as a chat conversation, or the reason it is quarantined.

Kept apart from the ingestion that commits lines exactly once (`osd/ingest.py`) because what a line means is a
question of the log formats servers write, not of files and offsets: OpenAI-style {messages, response | choices}
(also nested as {request: {messages}, response}) and plain {prompt, completion | response}. JSON nested too deeply
to parse and numbers too long to convert are quarantined with their reason (as is text with lone surrogates, by the
record reader), and every text and id of an accepted line is redacted (`osd/redact.py`) before it is returned.
"""

from __future__ import annotations

import json
from typing import Any

from speculators_train.data.conversations import Conversation, SkipReport, normalize_record
from speculators_train.osd.redact import RedactionFailed, Redactor


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
