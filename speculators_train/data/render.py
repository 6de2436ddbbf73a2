"""Render conversations with the target's chat template and build the loss mask of what the model writes.

Each assistant turn is placed after the prompt an engine sends for it, as the engine tokenises it, followed by the
reply's own tokens (`data/chat.py`: P_i, then the reply as the template writes it). The mask covers the reply's own
text and its end-of-turn token, never the role header, system or user text, nor template text the model is not
asked to write:

    <|im_start|>assistant\\n  Hello there<|im_end|>  \\n
    \\____ prompt: 0 ______/  \\______ 1 _________/  0

Turns share one sample while each turn's prompt tokens start with the sample's tokens through the previous reply's
end-of-turn token (ChatML: one sample per conversation); a template that renders history differently from how it
was generated (Qwen3's think blocks, Mistral's moving system message), or a tokenizer that merges a prompt's last
characters with the reply's first ones, starts a new sample at that turn. So every trained token follows exactly
the tokens an engine would have in context. A reply's character spans map to its tokens through the fast
tokenizer's offsets: a token is trained on when it overlaps the span (its first token may carry the space before
it).

A turn with images, for a multimodal target, renders its images' placeholders; each prompt that holds images is
tokenised by the target's processor, which expands every placeholder into the image's tokens as the served model
reads them, and whose pixel values go with the sample to the target's forward. Image tokens sit in prompts, so the
mask never covers them. A text-only target reads such a turn's text, and a record with a turn of images alone is
skipped (`non_text_content`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from speculators_train.data.chat import HEADER_WINDOW, Chat, EmptyReply
from speculators_train.data.config import ImagesConfig
from speculators_train.data.conversations import Conversation, SkipReport, has_images
from speculators_train.data.images import BadImage, shown
from speculators_train.data.images import load as load_image

# A text longer than this many head windows (`max_length + 1` tokens of the longest length) is tokenised by its head
# alone; shorter ones whole.
LONG_TEXT_FACTOR = 4


@dataclass
class Sample:
    id: str  # the record's id for its first sample, `<record id>#<n>` for the n-th after it
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool, True on what the model writes: replies + end-of-turn tokens
    record: str = ""  # the record's id (what decides the held-out split); the sample's id when empty
    # The processor's tensors for the sample's images (pixel values, grid sizes) as the target's forward takes them
    vision: dict[str, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        self.record = self.record or self.id


@dataclass
class _Tokens:
    """A sample being built: its ids, mask, and whether every text in it was tokenised whole (not by its head)."""

    ids: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    complete: bool = True
    through: list[int] = field(default_factory=list)  # ids through the last reply's end-of-turn token
    vision: dict[str, torch.Tensor] | None = None  # the processor's tensors for every image in the sample


class MaskLeak(ValueError):
    """A reply's loss mask would hold template text: a line of the prompt's user or system text, or the assistant
    header again (a template whose render the reply's span cannot be read from exactly)."""


def _leak(chat: Chat, messages: list[dict], i: int, masked: str) -> str | None:
    """What of the template's text `masked` (turn i's trained text) holds, or None: a line (4+ characters) of the
    user and system turns since the last reply that the reply itself does not contain, or, at its start, the
    header the engine's prompt already ends with."""
    own = messages[i]["content"] + "\n" + (messages[i].get("reasoning") or "")
    head = masked[:HEADER_WINDOW]  # template text sits before the reply's own: the check costs linear time
    for message in reversed(messages[:i]):
        if message["role"] == "assistant":
            break
        for line in message["content"].splitlines():
            line = line.strip()
            if len(line) >= 4 and line in head and line not in own:
                return f"{message['role']} text {line[:40]!r}"
    header = chat.assistant_header.strip()
    if header and masked.lstrip().startswith(header) and not own.lstrip().startswith(header):
        return f"the assistant header {header!r} again"
    return None


class NoImageProcessor(BadImage):
    """Images for a multimodal target whose processor could not be loaded."""


def _images(conv: Conversation, policy: ImagesConfig) -> list:
    """The conversation's images in order, as RGB pictures, read as `policy` (`data.images`) allows."""
    out = []
    for n, message in enumerate(conv.messages):
        for part in message.get("parts", ()):
            if part["type"] == "image":
                try:
                    out.append(load_image(part["image"], policy))
                except BadImage as exc:
                    raise BadImage(f"turn {n} image {shown(part['image'])}: {exc}") from None
    return out


def _image_prompt(chat: Chat, prompt: str, images: list) -> tuple[list[int], dict[str, torch.Tensor]]:
    """A prompt holding `images` tokenised by the target's processor: its ids (each placeholder expanded into the
    image's tokens) and the tensors the target's forward takes for those images."""
    out = chat.processor(text=[prompt], images=images, add_special_tokens=False, return_tensors="pt")
    vision = {key: value for key, value in out.items() if key not in ("input_ids", "attention_mask")}
    return out["input_ids"][0].tolist(), vision


def conversation_tokens(conv: Conversation, chat: Chat, max_length: int) -> tuple[list[_Tokens], str]:
    """The conversation's samples as ids and masks (before truncation), and why there are none when there are none.

    Turns whose prompt alone fills `max_length` tokens are not rendered: they would be truncated away, and on long
    conversations the prefix renders are quadratic in the turn count."""
    tokenizer = chat.tokenizer
    need = max_length + 1  # one token past the cut says where the cut falls
    messages = list(conv.messages)
    if chat.no_images and any(map(has_images, messages)):
        raise NoImageProcessor(f"the target reads images but {chat.no_images}")
    if chat.processor is None and any(has_images(m) and not m["content"].strip() for m in messages):
        return [], "non_text_content"  # a turn of images alone, for a target that reads no images
    images = _images(conv, chat.images) if chat.processor is not None and any(map(has_images, messages)) else []
    out: list[_Tokens] = []
    current: _Tokens | None = None
    reason = "no_reply_after_a_prompt"
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        try:
            reply = chat.reply(messages, i)
        except EmptyReply:  # nothing to train on in this turn; it stays context for the next
            continue
        shown = sum(p["type"] == "image" for m in messages[:i] for p in m.get("parts", ())) if images else 0
        vision = None
        if shown:
            prompt_ids, vision = _image_prompt(chat, reply.prompt, images[:shown])
            prompt_whole = True
        else:
            prompt_ids, _, prompt_whole = _tokens(tokenizer, reply.prompt, need)
        if not prompt_whole or len(prompt_ids) >= max_length:
            reason = "no_assistant_tokens_in_max_length"
            break
        if leak := _leak(chat, messages, i, reply.reply[reply.mask_start : reply.mask_end]):
            raise MaskLeak(f"turn {i}: the loss mask would train on {leak}")
        reply_ids, offsets, reply_whole = _tokens(tokenizer, reply.reply, need)
        reply_mask = [end > reply.mask_start and start < reply.mask_end for start, end in offsets]
        chained = current is not None and prompt_ids[: len(current.through)] == current.through
        if chained:
            kept = current.mask[: len(current.through)]
            mask = kept + [False] * (len(prompt_ids) - len(kept)) + reply_mask
        else:
            if current is not None:
                out.append(current)
            mask = [False] * len(prompt_ids) + reply_mask
        last = max((t for t, on in enumerate(reply_mask) if on), default=-1)
        current = _Tokens(
            prompt_ids + reply_ids,
            mask,
            reply_whole and (current.complete if chained else True),
            prompt_ids + reply_ids[: last + 1],
            vision,
        )
    if current is not None:
        out.append(current)
    return out, reason


def _tokens(tokenizer, text: str, need: int) -> tuple[list[int], list[tuple[int, int]], bool]:
    """Ids and offsets of `text` as the tokenizer splits it alone, and whether they are all of them: a text far
    longer than `need` tokens can span is tokenised by its head (`_head_tokens`), so a 50 MB record costs what a
    short one does."""
    if len(text) <= LONG_TEXT_FACTOR * need * _longest_token(tokenizer):
        return (*_encode(tokenizer, text), True)
    return _head_tokens(tokenizer, text, need)


def _template_error(report: SkipReport, conv: Conversation, exc: Exception) -> None:
    report.skip("chat_template_error", f"{conv.origin} ({str(exc)[:80]})")


def render_many(
    convs: list[Conversation], chat: Chat, max_length: int, overlong: str, report: SkipReport
) -> list[list[Sample]]:
    """Each conversation's samples. Over-long samples are truncated or dropped by setting; a record left with no
    sample is counted in `report` with the reason."""
    out: list[list[Sample]] = []
    for conv in convs:
        try:
            built, why = conversation_tokens(conv, chat, max_length)
        except (BadImage, MaskLeak) as exc:
            reason = "no_image_processor" if isinstance(exc, NoImageProcessor) else "bad_image"
            reason = "mask_holds_template_text" if isinstance(exc, MaskLeak) else reason
            report.skip(reason, f"{conv.origin} ({exc})")
            out.append([])
            continue
        except Exception as exc:  # jinja raises TemplateError for e.g. non-alternating roles
            _template_error(report, conv, exc)
            out.append([])
            continue
        samples: list[Sample] = []
        reasons: list[tuple[str, str]] = []
        for tokens in built:
            kept = _cut(tokens, max_length, overlong, reasons)
            if kept is not None:
                name = conv.id if not samples else f"{conv.id}#{len(samples)}"
                samples.append(Sample(name, *kept, conv.id, tokens.vision))
        if not samples:  # its first sample's reason, or why it had none
            reason, detail = reasons[0] if reasons else (why, "")
            report.skip(reason, f"{conv.origin} ({detail})" if detail else conv.origin)
        out.append(samples)
    return out


def _cut(
    tokens: _Tokens, max_length: int, overlong: str, reasons: list[tuple[str, str]]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(ids, loss mask) of one sample, truncated or dropped past `max_length`; None (with the reason appended to
    `reasons`) when nothing is left to train on."""
    ids, mask = tokens.ids, tokens.mask
    if len(ids) > max_length:
        if overlong == "drop":
            size = f"{len(ids)} > {max_length} tokens" if tokens.complete else f"over {max_length} tokens"
            reasons.append(("overlong", size))
            return None
        ids, mask = ids[:max_length], mask[:max_length]
    if not any(mask):
        reasons.append(("no_assistant_tokens_in_max_length", ""))
        return None
    return torch.tensor(ids, dtype=torch.int64), torch.tensor(mask, dtype=torch.bool)


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


def render(conv: Conversation, chat: Chat, max_length: int, overlong: str, report: SkipReport) -> list[Sample]:
    """One conversation's samples; see render_many."""
    return render_many([conv], chat, max_length, overlong, report)[0]
