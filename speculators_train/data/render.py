"""Render conversations with the target's chat template and build the assistant-only loss mask.

The mask covers each assistant turn's content and its end-of-turn token, not the role header:

    <|im_start|>assistant\\n  Hello there<|im_end|>  \\n
    \\____ header: 0 ______/  \\______ 1 _________/  0

Spans come from rendering message prefixes (so any template works, no per-model regexes) and are
mapped to tokens through the fast tokenizer's offsets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speculators_train.data.conversations import Conversation, SkipReport


@dataclass
class Sample:
    id: str
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool, True on assistant content + end-of-turn tokens


def assistant_spans(conv: Conversation, tokenizer, text: str, limit: int) -> list[tuple[int, int]]:
    """Character spans of assistant content (+ end-of-turn), header excluded, in the rendered `text`.

    Turns that start past character `limit` (the first token truncation drops) are not rendered: on long
    conversations the prefix renders are quadratic in the turn count."""
    messages = list(conv.messages)
    spans = []
    prev_end = 0
    for i, message in enumerate(messages):
        if prev_end > limit:
            break
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not text.startswith(through):
            raise ValueError("chat template renders a prefix of the conversation differently from the whole")
        if message["role"] == "assistant":
            end = len(through.rstrip())
            before = (
                tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else None
            )
            if before is not None and text.startswith(before):
                start = len(before)
            else:
                # The template adds text of its own before this turn (e.g. a default system prompt when
                # the conversation opens with the assistant): find the content inside this turn instead.
                content = message["content"].strip()
                start = text.rfind(content, prev_end, end) if content else end
                if start < 0:
                    raise ValueError(f"assistant turn {i} not found in the rendered template")
            if end > start:
                spans.append((start, end))
        prev_end = len(through)
    return spans


def _template_error(report: SkipReport, conv: Conversation, exc: Exception) -> None:
    report.skip("chat_template_error", f"{conv.origin} ({str(exc)[:80]})")


def render_many(
    convs: list[Conversation], tokenizer, max_length: int, overlong: str, report: SkipReport
) -> list[Sample | None]:
    """Tokenise conversations (one tokenizer call, which a fast tokenizer spreads over all cores).

    Over-long samples are truncated or dropped by setting; each skip is counted in `report`."""
    texts: list[str | None] = []
    for conv in convs:
        try:
            texts.append(tokenizer.apply_chat_template(list(conv.messages), tokenize=False))
        except Exception as exc:  # jinja raises TemplateError for e.g. non-alternating roles
            _template_error(report, conv, exc)
            texts.append(None)
    rendered = [t for t in texts if t is not None]
    encoded = tokenizer(rendered, add_special_tokens=False, return_offsets_mapping=True) if rendered else None
    out: list[Sample | None] = []
    k = 0
    for conv, text in zip(convs, texts, strict=True):
        if text is None:
            out.append(None)
            continue
        ids, offsets = encoded["input_ids"][k], encoded["offset_mapping"][k]
        k += 1
        out.append(_sample(conv, tokenizer, text, ids, offsets, max_length, overlong, report))
    return out


def _sample(
    conv: Conversation,
    tokenizer,
    text: str,
    ids: list[int],
    offsets: list[tuple[int, int]],
    max_length: int,
    overlong: str,
    report: SkipReport,
) -> Sample | None:
    """One encoded conversation: truncate or drop, then mask the assistant spans inside what is kept."""
    if len(ids) > max_length:
        if overlong == "drop":
            report.skip("overlong", f"{conv.origin} ({len(ids)} > {max_length} tokens)")
            return None
        ids, limit = ids[:max_length], offsets[max_length][0]
    else:
        limit = len(text)
    try:
        spans = assistant_spans(conv, tokenizer, text, limit)
    except Exception as exc:
        _template_error(report, conv, exc)
        return None
    mask = [False] * len(ids)
    span_index = 0
    for t, (start, _end) in enumerate(offsets[: len(ids)]):
        while span_index < len(spans) and start >= spans[span_index][1]:
            span_index += 1
        if span_index < len(spans) and start >= spans[span_index][0]:
            mask[t] = True
    if not any(mask):
        report.skip("no_assistant_tokens_in_max_length", conv.origin)
        return None
    return Sample(conv.id, torch.tensor(ids, dtype=torch.int64), torch.tensor(mask, dtype=torch.bool))


def render(conv: Conversation, tokenizer, max_length: int, overlong: str, report: SkipReport) -> Sample | None:
    """One conversation; see render_many."""
    return render_many([conv], tokenizer, max_length, overlong, report)[0]
