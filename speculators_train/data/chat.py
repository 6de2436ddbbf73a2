"""The target's chat template as a serving engine applies it, and where each reply sits in what it renders.

An engine prompts the model for assistant turn i with `render(messages[:i], add_generation_prompt=True)` (P_i)
and the model writes the turn. Templates do not all render a conversation as the concatenation of those prompts
and replies: Qwen3 gives the last reply an (empty) think block and strips reasoning from earlier ones, gpt-oss ends
the last reply with <|return|> and earlier ones with <|end|>, Phi-3 appends the end-of-sequence token without a
generation prompt, Mistral v0.3 moves the system message into the last user turn. So each reply is found in the
render of the conversation up to and including it (F_i = render(messages[:i+1])), where the template writes it as
the model would, and is read as

    F_i = history | header | own text | footer
                  \\______ reply R_i ______/

where `own text` is what the message itself supplies (its content, and its reasoning where the template keeps
it), found by rendering the same turn with stand-in text: the two renders agree before and after it. `header` is
template text between the engine's prompt and the own text (gpt-oss's `<|channel|>final<|message|>`, Qwen3's empty
think block), `footer` what follows (end-of-turn token, newline, Phi-3's end-of-sequence). The model writes own
text and footer up to the end-of-turn token (the footer's first special token), and the header where the template
writes it before every reply (a channel header), not where it writes it only for the last one (an empty think
block that no serving prompt asks the model for). `render.py` turns these into samples and loss masks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from speculators_train.data.config import ImagesConfig
from speculators_train.data.conversations import REASONING_FIELDS, has_images
from speculators_train.errors import UserError

# Stand-in text for a reply: the first candidate that the reply itself does not contain.
STAND_INS = ("§", "¤", "¶", "\u2063")
# A reply's header is found within this many characters before its own text when the engine's prompt is not a
# prefix of the turn's render (Mistral v0.3 with a system message): far longer than any template's header.
HEADER_WINDOW = 512


def template_messages(messages, images: bool = False) -> list[dict[str, Any]]:
    """Messages as chat templates read them: a reply's reasoning under every key a template reads it from (Qwen3 and
    DeepSeek `reasoning_content`, gpt-oss `thinking`, vLLM's `reasoning`); with `images`, a turn with images as its
    content parts (`{"type": "image"}` where the template writes the image's placeholder), else its text."""
    out = []
    for message in messages:
        content: Any = message["content"]
        if images and has_images(message):
            content = [{"type": "image"} if p["type"] == "image" else p for p in message["parts"]]
        reasoning = message.get("reasoning")
        if reasoning is None:
            out.append({"role": message["role"], "content": content})
        else:
            out.append({"role": message["role"], "content": content, **dict.fromkeys(REASONING_FIELDS, reasoning)})
    return out


def common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix (slice comparisons run in C: fast on megabyte texts)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low


def common_suffix(a: str, b: str, limit: int) -> int:
    """Length of the longest common suffix, at most `limit`."""
    low, high = 0, min(len(a), len(b), limit)
    while low < high:
        mid = (low + high + 1) // 2
        if a[len(a) - mid :] == b[len(b) - mid :]:
            low = mid
        else:
            high = mid - 1
    return low


class EmptyReply(ValueError):
    """The template renders an assistant turn with no text of its own (an empty or, trimmed, blank reply)."""


@dataclass(frozen=True)
class Reply:
    """Assistant turn i as the engine meets it: `prompt` (P_i) and the `reply` the model writes after it, of which
    reply[mask_start:mask_end] is trained on."""

    prompt: str
    reply: str
    mask_start: int
    mask_end: int

    @property
    def through_end_of_turn(self) -> str:
        """The prompt and the reply up to its end-of-turn token: what the next turn's prompt must start with for
        both turns to share one sample."""
        return self.prompt + self.reply[: self.mask_end]


def template_arguments() -> frozenset[str]:
    """The names `apply_chat_template` takes as its own arguments (read from transformers' signature): a
    `chat_template_kwargs` key among them would collide with them rather than reach the template."""
    import inspect

    from transformers import PreTrainedTokenizerBase

    own = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    return frozenset(name for name, p in own.items() if name != "self" and p.kind is not p.VAR_KEYWORD)


@dataclass(frozen=True)
class Chat:
    """The target's tokenizer with its chat template and the recipe's `data.chat_template_kwargs` (e.g.
    `enable_thinking: false`), applied as a serving engine applies them. With a multimodal target's `processor`,
    turns with images render their images' placeholders (which the processor expands, `data/render.py`); without
    one, their text alone, or, where a multimodal target's processor is missing, they are refused (`no_images`)."""

    tokenizer: Any
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    processor: Any = None
    no_images: str = ""  # why a multimodal target's records with images cannot be read (no processor)
    images: ImagesConfig = field(default_factory=ImagesConfig)  # how its images are read (`data.images`)

    def __post_init__(self) -> None:
        # checked here, where the template is first used, not at recipe load (which imports no transformers)
        if taken := sorted(set(self.kwargs) & template_arguments()):
            raise UserError(
                f"data.chat_template_kwargs: {', '.join(taken)}: apply_chat_template's own argument(s), not "
                "variables of the template"
            )

    @classmethod
    def of(cls, target: Any, kwargs: Mapping[str, Any] | None = None, images: ImagesConfig | None = None) -> Chat:
        """A loaded target's chat template as an engine applies it, reading images through its processor."""
        return cls(target.tokenizer, kwargs or {}, target.processor, target.no_images, images or ImagesConfig())

    def render(self, messages, prompt: bool) -> str:
        """The template's text for `messages`, with the generation prompt when `prompt`."""
        # A multimodal checkpoint may keep its template with the processor alone (chat_template.jinja)
        own = getattr(self.tokenizer, "chat_template", None)
        template = None if own else getattr(self.processor, "chat_template", None)
        return self.tokenizer.apply_chat_template(
            template_messages(messages, self.processor is not None),
            chat_template=template,
            tokenize=False,
            add_generation_prompt=prompt,
            **self.kwargs,
        )

    def prompt_ids(self, messages) -> list[int]:
        """The ids an engine feeds for `messages` (a chat request): the rendered prompt, tokenised as it is."""
        return self.tokenizer(self.render(messages, True), add_special_tokens=False)["input_ids"]

    @cached_property
    def special_tokens(self) -> tuple[str, ...]:
        """Every special token's text, longest first (so `<|end|>` is not taken for a prefix of a longer one)."""
        tokens = set(self.tokenizer.all_special_tokens)
        tokens.update(t.content for t in self.tokenizer.added_tokens_decoder.values() if t.special)
        return tuple(sorted((t for t in tokens if t), key=len, reverse=True))

    def end_of_turn(self, footer: str) -> int:
        """Characters of `footer` the model writes: through its first special token (the end-of-turn token); 0
        when it has none (a template that ends a reply without one)."""
        hits = [(footer.find(t), -len(t)) for t in self.special_tokens if t in footer]
        if not hits:
            return 0
        at, minus_length = min(hits)
        return at - minus_length

    def reply(self, messages: list[dict[str, str]], i: int) -> Reply:
        """Assistant turn `i` of `messages` as the engine prompts for it and the model writes it. ValueError when the
        template does not render the turn's own text recognisably."""
        whole = self.render(messages[: i + 1], False)
        if i == 0:
            # A reply that opens the conversation (ShareGPT has such records) has no prompt to render (transformers
            # refuses an empty conversation): what the template writes before its own text stands in for one.
            own_start, own_end = self._own_text(messages, i, whole)
            return Reply(
                whole[:own_start], whole[own_start:], 0, own_end - own_start + self.end_of_turn(whole[own_end:])
            )
        prompt = self.render(messages[:i], True)
        if not whole.startswith(prompt) and messages[i].get("reasoning") is not None:
            # The template renders this reply's reasoning where its generation prompt rules reasoning out (Qwen3 with
            # enable_thinking false closes an empty think block in the prompt): served so, the model writes none.
            messages = [*messages[:i], {"role": "assistant", "content": messages[i]["content"]}]
            whole = self.render(messages, False)
        own_start, own_end = self._own_text(messages, i, whole)
        if whole.startswith(prompt) and len(prompt) <= own_start:
            start = len(prompt)
        else:
            start = _after_prompt(whole, own_start, prompt)
        end = own_end + self.end_of_turn(whole[own_end:])
        if end == own_end and (closing := self._closing(messages, i, whole[:own_end])):
            whole, end = whole[:own_end] + closing, own_end + len(closing)
        header = whole[start:own_start]
        model_writes_header = header and self._written_before_every_reply(messages, i, whole[start:own_end])
        return Reply(prompt, whole[start:], (0 if model_writes_header else own_start - start), end - start)

    def _own_text(self, messages: list[dict[str, str]], i: int, whole: str) -> tuple[int, int]:
        """Where turn i's own text sits in `whole` (its render as the last turn): the stretch that changes when the
        message's content (and reasoning) are replaced by stand-in text."""
        message = messages[i]
        text = message["content"] + (message.get("reasoning") or "")
        stand_in = next((s for s in STAND_INS if s not in text), STAND_INS[-1] * 3)
        swapped = {"role": "assistant", "content": stand_in}
        if message.get("reasoning") is not None:
            swapped["reasoning"] = stand_in
        other = self.render([*messages[:i], swapped], False)
        start = common_prefix(whole, other)
        end = len(whole) - common_suffix(whole[start:], other[start:], len(whole) - start)
        if end <= start:
            raise EmptyReply(f"assistant turn {i} renders no text of its own")
        return start, end

    def _closing(self, messages: list[dict[str, str]], i: int, through: str) -> str:
        """The special token that ends reply i where its render ends with nothing after it (GLM-4.5: the next
        turn's `<|user|>` tag, which the model writes to stop): the first one the template writes after the reply
        when a user turn follows; "" where there is none."""
        try:
            later = self.render([*messages[: i + 1], {"role": "user", "content": "…"}], False)
        except Exception:  # a template may refuse the extra turn
            return ""
        if not later.startswith(through):
            return ""
        footer = later[len(through) :]
        return footer[: self.end_of_turn(footer)] if self.end_of_turn(footer) else ""

    def _written_before_every_reply(self, messages: list[dict[str, str]], i: int, reply_text: str) -> bool:
        """Whether the template writes this header before the reply when the reply is not the last message too."""
        try:
            later = self.render([*messages[: i + 1], {"role": "user", "content": "…"}], False)
        except Exception:  # a template may refuse the extra turn; the header is then not known to be the model's
            return False
        return reply_text in later

    @cached_property
    def assistant_header(self) -> str:
        """What the generation prompt adds after a conversation: the header an engine ends its prompt with."""
        probe = [{"role": "user", "content": "¤"}]
        try:
            prompt, plain = self.render(probe, True), self.render(probe, False)
        except Exception:  # a template that cannot render the probe has no header known here
            return ""
        return prompt[len(plain) :] if prompt.startswith(plain) else ""

    @cached_property
    def reply_shapes(self) -> list[tuple[str, ...]]:
        """How the template writes a last reply, as the text around its parts: (header, between reasoning and
        content, footer) for a reply with reasoning where the template keeps it, then (header, footer) for one
        without. `as_message` reads generated text against them."""
        shapes = []
        for reasoning in ("¶", None):
            reply = {"role": "assistant", "content": "§", **({"reasoning": reasoning} if reasoning else {})}
            try:
                turn = self.reply([{"role": "user", "content": "¤"}, reply], 1)
            except Exception:  # a template that cannot render the probe: generated text is taken as it is
                continue
            text = turn.reply[: turn.mask_end]
            if reasoning and "¶" in text and text.index("¶") < text.index("§"):
                head, rest = text.split("¶", 1)
                shapes.append((head, *rest.split("§", 1)))
            elif not reasoning and "§" in text:
                shapes.append(tuple(text.split("§", 1)))
        return shapes

    def as_message(self, generated: str) -> dict[str, str]:
        """A generated reply (decoded with its special tokens) as the assistant message that renders back to it:
        the template's header and end-of-turn token removed, reasoning (where the template has a place for it)
        split from the content."""
        for shape in self.reply_shapes:
            head, foot = shape[0], shape[-1].strip()
            if not generated.startswith(head):
                continue
            body = generated[len(head) :]
            if foot and foot in body:
                body = body[: body.index(foot)]
            if len(shape) == 3:
                if shape[1] not in body:
                    continue
                reasoning, content = (self._plain(part) for part in body.split(shape[1], 1))
                return {"role": "assistant", "content": content, **({"reasoning": reasoning} if reasoning else {})}
            return {"role": "assistant", "content": self._plain(body)}
        return {"role": "assistant", "content": self._plain(generated)}

    def _plain(self, text: str) -> str:
        """Text without special tokens (an end-of-sequence after the end-of-turn token, a stray header)."""
        for token in self.special_tokens:
            text = text.replace(token, "")
        return text.strip()


def _after_prompt(whole: str, own_start: int, prompt: str) -> int:
    """Where the reply begins in `whole` when the engine's `prompt` is not a prefix of it: after the longest run of
    the prompt's last characters that ends within the window before the own text (the generation prompt is written
    the same way in both; what precedes it may not be, as when a template moves the system message)."""
    best, best_at = -1, own_start
    for at in range(own_start, max(own_start - HEADER_WINDOW, 0) - 1, -1):
        matched = common_suffix(whole[max(at - HEADER_WINDOW, 0) : at], prompt, HEADER_WINDOW)
        if matched > best:
            best, best_at = matched, at
    return best_at
