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


def assistant_spans(conv: Conversation, tokenizer) -> tuple[str, list[tuple[int, int]]]:
    """Full rendered text and the character spans of assistant content (+ end-of-turn), header excluded."""
    messages = list(conv.messages)
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = []
    prev_end = 0
    for i, message in enumerate(messages):
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
    return text, spans


def render(conv: Conversation, tokenizer, max_length: int, overlong: str, report: SkipReport) -> Sample | None:
    """Tokenise one conversation; over-long samples are truncated or dropped by setting, each skip counted."""
    try:
        text, spans = assistant_spans(conv, tokenizer)
    except Exception as exc:  # jinja raises TemplateError for e.g. non-alternating roles
        report.skip("chat_template_error", f"{conv.origin} ({str(exc)[:80]})")
        return None
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = encoded["input_ids"]
    mask = [False] * len(ids)
    span_index = 0
    for t, (start, _end) in enumerate(encoded["offset_mapping"]):
        while span_index < len(spans) and start >= spans[span_index][1]:
            span_index += 1
        if span_index < len(spans) and start >= spans[span_index][0]:
            mask[t] = True
    if len(ids) > max_length:
        if overlong == "drop":
            report.skip("overlong", f"{conv.origin} ({len(ids)} > {max_length} tokens)")
            return None
        ids, mask = ids[:max_length], mask[:max_length]
    if not any(mask):
        report.skip("no_assistant_tokens_in_max_length", conv.origin)
        return None
    return Sample(conv.id, torch.tensor(ids, dtype=torch.int64), torch.tensor(mask, dtype=torch.bool))
