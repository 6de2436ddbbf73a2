"""Render conversations with the target's chat template and build the assistant-only loss mask.

The mask covers each assistant turn's content and its end-of-turn token, not the role header:

    <|im_start|>assistant\\n  Hello there<|im_end|>  \\n
    \\____ header: 0 ______/  \\______ 1 _________/  0

Spans come from rendering message prefixes (so any template works, no per-model regexes) and are
mapped to tokens through the fast tokenizer's offsets.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from speculators_train.data.conversations import Conversation, SkipReport

# A rendered text longer than this many head windows (`max_length + 1` tokens of the longest length) is tokenised by
# its head alone; shorter ones whole, in the one batched call.
LONG_TEXT_FACTOR = 4


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

    Over-long samples are truncated or dropped by setting; each skip is counted in `report`. A text far longer than
    `max_length` tokens can span is tokenised by its head alone (`_head_tokens`): a 50 MB record costs the
    tokenizer what a short one does, not gigabytes of per-token offsets."""
    texts: list[str | None] = []
    for conv in convs:
        try:
            texts.append(tokenizer.apply_chat_template(list(conv.messages), tokenize=False))
        except Exception as exc:  # jinja raises TemplateError for e.g. non-alternating roles
            _template_error(report, conv, exc)
            texts.append(None)
    need = max_length + 1  # one token past the cut says where the cut falls
    rendered = [t for t in texts if t is not None]
    long_chars = LONG_TEXT_FACTOR * need * _longest_token(tokenizer) if rendered else 0
    short = [t for t in rendered if len(t) <= long_chars]
    encoded = tokenizer(short, add_special_tokens=False, return_offsets_mapping=True) if short else None
    out: list[Sample | None] = []
    k = 0
    for conv, text in zip(convs, texts, strict=True):
        if text is None:
            out.append(None)
            continue
        if len(text) <= long_chars:
            ids, offsets, complete = encoded["input_ids"][k], encoded["offset_mapping"][k], True
            k += 1
        else:
            ids, offsets, complete = _head_tokens(tokenizer, text, need)
        out.append(_sample(conv, tokenizer, text, ids, offsets, complete, max_length, overlong, report))
    return out


@functools.lru_cache(maxsize=8)
def _longest_token(tokenizer) -> int:
    """Characters spelled by the vocabulary's longest token. A byte-level or SentencePiece token spells each byte or
    character it covers, so `n` tokens rarely span more than `n` times this: the first window `_head_tokens` tries."""
    return max(len(token) for token in tokenizer.get_vocab())


def _encode(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return encoding["input_ids"], encoding["offset_mapping"]


def _head_tokens(tokenizer, text: str, need: int) -> tuple[list[int], list[tuple[int, int]], bool]:
    """The first `need` tokens of `text` and their offsets, and whether they are all of its tokens, from prefixes.

    A prefix tokenises as the whole text does except next to its cut (a merge or pre-token split that the missing
    characters would change), so prefixes of doubling length are tokenised until two agree on the first `need`
    tokens, or until the prefix is the whole text. Time and memory follow `need`, not the text's length."""
    window = need * _longest_token(tokenizer)
    ids, offsets = _encode(tokenizer, text[:window])
    while window < len(text):
        window *= 2
        wider_ids, wider_offsets = _encode(tokenizer, text[:window])
        if len(ids) > need and ids[:need] == wider_ids[:need] and offsets[:need] == wider_offsets[:need]:
            return ids[:need], offsets[:need], False
        ids, offsets = wider_ids, wider_offsets
    return ids, offsets, True


def _sample(
    conv: Conversation,
    tokenizer,
    text: str,
    ids: list[int],
    offsets: list[tuple[int, int]],
    complete: bool,
    max_length: int,
    overlong: str,
    report: SkipReport,
) -> Sample | None:
    """One encoded conversation: truncate or drop, then mask the assistant spans inside what is kept.

    `ids` are all the text's tokens if `complete`, else only its first `max_length + 1` (it is over-long)."""
    if len(ids) > max_length:
        if overlong == "drop":
            size = f"{len(ids)} > {max_length} tokens" if complete else f"over {max_length} tokens, {len(text):,} chars"
            report.skip("overlong", f"{conv.origin} ({size})")
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
