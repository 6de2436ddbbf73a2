"""Loss masks from chat templates written in each family's released style (tests/targets.py): every trained token
follows exactly the prompt an engine sends for its turn, and the mask covers what the model writes after it."""

from __future__ import annotations

import pytest

from speculators_train.data.chat import Chat
from speculators_train.data.conversations import Conversation, SkipReport, normalize_record
from speculators_train.data.render import render
from tests.targets import TEMPLATES, template_tokenizer

SYSTEM = {"role": "system", "content": "Be brief."}
TWO_TURNS = [
    SYSTEM,
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Tell a joke"},
    {"role": "assistant", "content": "Why did the chicken cross the road?"},
]
REASONED = [*TWO_TURNS[:-1], {**TWO_TURNS[-1], "reasoning": "A classic one."}]

# What the model writes for each reply of TWO_TURNS (its text and end-of-turn token, and the header a template
# writes before every reply), and how many samples the conversation makes: one while each turn's prompt starts
# with the text so far, one per turn where the template renders history differently.
EXPECTED = {
    "chatml": (["{}<|im_end|>"], 1),
    "qwen3": (["{}<|im_end|>"], 2),  # the last reply's empty think block is the template's, not the model's
    # SmolLM2's pre-tokenizer splits "\n\nHello" as "\n", "\n", "Hello" where the prompt an engine tokenises alone
    # ends in the one token "\n\n": each reply is then its own sample (Llama-3's own tokenizer keeps "\n\n" whole)
    "llama3": (["{}<|eot_id|>"], 2),
    "mistral": ([" {}</s>"], 2),  # the system message moves into the last user turn
    "gemma": (["{}<end_of_turn>"], 1),
    "phi3": (["{}<|end|>"], 1),  # the end-of-sequence token after a conversation is not written by the model
    "harmony": (["<|channel|>final<|message|>{}<|return|>"], 2),  # <|end|> closes a reply in history
    "deepseek": (["{}<｜end▁of▁sentence｜>"], 1),
    "llama4": (["{}<|eot|>"], 2),  # as llama3
}


@pytest.fixture(scope="module")
def chats():
    """A tokenizer per template, built once for the module."""
    return {name: Chat(template_tokenizer(name)) for name in TEMPLATES}


def masked_runs(sample) -> list[tuple[int, int]]:
    """(start, end) of each run of trained tokens."""
    runs, start = [], None
    mask = sample.loss_mask.tolist()
    for t, on in enumerate([*mask, False]):
        if on and start is None:
            start = t
        elif not on and start is not None:
            runs.append((start, t))
            start = None
    return runs


def turns_of(chat: Chat, messages: list[dict], samples) -> list[tuple[list[int], str]]:
    """For each reply, (the prompt an engine sends for it as ids, the trained text that follows those ids in a
    sample): a prompt no sample starts with fails the test."""
    tokenizer = chat.tokenizer
    out = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = chat.prompt_ids(messages[:i])
        holders = [s for s in samples if s.input_ids[: len(prompt)].tolist() == prompt]
        assert holders, f"no sample starts with the engine's prompt for turn {i}"
        sample = holders[0]
        runs = [r for r in masked_runs(sample) if r[0] >= len(prompt)]
        assert not sample.loss_mask[: len(prompt)].tolist()[-1]  # the prompt's last token is context
        start, end = runs[0]
        assert not sample.loss_mask[len(prompt) : start].any()
        out.append((prompt, tokenizer.decode(sample.input_ids[start:end])))
    return out


@pytest.mark.parametrize("name", list(EXPECTED))
def test_each_reply_is_trained_after_the_prompt_an_engine_sends_for_it(chats, name):
    chat = chats[name]
    report = SkipReport()
    samples = render(Conversation("c", tuple(TWO_TURNS), "c:1"), chat, 4096, "truncate", report)
    (pattern,), count = EXPECTED[name]
    assert report.total == 0 and len(samples) == count, (report.counts, len(samples))
    replies = [m["content"] for m in TWO_TURNS if m["role"] == "assistant"]
    assert [text for _, text in turns_of(chat, TWO_TURNS, samples)] == [pattern.format(r) for r in replies]
    # every trained token is one of those replies: nothing else in any sample is trained on
    trained = sum(int(s.loss_mask.sum()) for s in samples)
    assert trained == sum(
        len(chat.tokenizer(pattern.format(r), add_special_tokens=False)["input_ids"]) for r in replies
    )


def test_qwen3_reasoning_is_trained_where_the_template_keeps_it_and_not_when_thinking_is_off(chats):
    qwen3 = chats["qwen3"]
    samples = render(Conversation("c", tuple(REASONED), "c:1"), qwen3, 4096, "truncate", SkipReport())
    _, last = turns_of(qwen3, REASONED, samples)[-1]
    assert last == "A classic one.\n</think>\n\nWhy did the chicken cross the road?<|im_end|>"
    off = Chat(qwen3.tokenizer, {"enable_thinking": False})
    samples = render(Conversation("c", tuple(REASONED), "c:1"), off, 4096, "truncate", SkipReport())
    _, (prompt, last) = turns_of(off, REASONED, samples)
    assert last == "Why did the chicken cross the road?<|im_end|>"
    assert off.tokenizer.decode(prompt).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert all("A classic one" not in off.tokenizer.decode(s.input_ids) for s in samples)


def test_gpt_oss_reasoning_and_final_channel_are_trained(chats):
    harmony = chats["harmony"]
    samples = render(Conversation("c", tuple(REASONED), "c:1"), harmony, 4096, "truncate", SkipReport())
    _, last = turns_of(harmony, REASONED, samples)[-1]
    final = "<|start|>assistant<|channel|>final<|message|>Why did the chicken cross the road?<|return|>"
    assert last == "A classic one.<|end|>" + final


def test_a_record_s_reasoning_field_reaches_the_template():
    record = {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "thinking": "R"}]}
    conv = normalize_record(record, "s", "s:1", SkipReport())
    assert conv.messages[1] == {"role": "assistant", "content": "A", "reasoning": "R"}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_generated_replies_read_back_as_the_messages_that_render_them(chats, name):
    """Regeneration decodes the target's reply with its special tokens; `as_message` strips the template's header
    and end-of-turn token (and splits reasoning), so the regenerated conversation renders what was generated."""
    chat = chats[name]
    for messages in (TWO_TURNS, REASONED):
        reply = chat.reply(messages, len(messages) - 1)
        generated = reply.reply[: reply.mask_end]
        message = chat.as_message(generated + "<|endoftext|>")  # what a model may write after its end-of-turn
        again = chat.reply([*messages[:-1], message], len(messages) - 1)
        assert again.reply[: again.mask_end] == generated, (name, message)


# DeepSeek-R1's released template: history drops a reply's reasoning, and the generation prompt opens a think block
R1 = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{- '<｜User｜>' + message.content }}"
    "{%- elif message.role == 'assistant' %}{%- set content = message.content %}"
    "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1] %}{%- endif %}"
    "{{- '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<｜Assistant｜><think>\\n' }}{%- endif %}"
)


def test_a_mask_that_would_hold_template_text_is_refused_and_counted():
    """On DeepSeek-R1's template the engine's prompt is no prefix of the render, and a user message holding a
    newline once put its last line and the assistant tag into the reply's mask (exit 0, nothing counted): each
    sample's masked text is now read back, and one holding prompt text is a counted skip."""
    from speculators_train.data.render import _leak

    tokenizer = template_tokenizer("deepseek", ("<think>", "</think>"))
    tokenizer.chat_template = R1
    chat = Chat(tokenizer)
    reply = {"role": "assistant", "content": "The answer is 4."}
    report = SkipReport()
    multi = [{"role": "user", "content": "Line one\nsecond line here"}, reply]
    assert render(Conversation("c", tuple(multi), "c:1"), chat, 4096, "truncate", report) == []
    assert report.counts == {"mask_holds_template_text": 1}
    assert "user text 'second line here'" in report.examples["mask_holds_template_text"][0]
    single = [{"role": "user", "content": "What is 2 + 2?"}, reply]
    (sample,) = render(Conversation("c", tuple(single), "c:2"), chat, 4096, "truncate", report)
    trained = [t for t, on in zip(sample.input_ids.tolist(), sample.loss_mask.tolist(), strict=True) if on]
    assert tokenizer.decode(trained) == "The answer is 4.<｜end▁of▁sentence｜>"
    # a reply that quotes the user is no leak; the assistant header trained again is one
    quoted = [{"role": "user", "content": "Say: hello world"}, {"role": "assistant", "content": "hello world"}]
    assert _leak(Chat(template_tokenizer("deepseek")), quoted, 1, "hello world<｜end▁of▁sentence｜>") is None
    assert "assistant header" in _leak(Chat(template_tokenizer("deepseek")), single, 1, "<｜Assistant｜>The answer")


@pytest.mark.parametrize("name", list(EXPECTED))
def test_no_shipped_template_style_trips_the_mask_check(chats, name):
    """Every template style of the matrix, with a user message of several lines: nothing is refused."""
    messages = [SYSTEM, {"role": "user", "content": "First line\nsecond line\nthird"}, TWO_TURNS[2]]
    report = SkipReport()
    assert render(Conversation("c", tuple(messages), "c:1"), chats[name], 4096, "truncate", report)
    assert report.total == 0, report.examples


# GLM-4.5's style: nothing after a reply in its render; the next turn's tag, which the model writes to stop, ends it
GLM45 = (
    "[gMASK]<sop>{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{- '<|user|>\\n' + message.content }}"
    "{%- elif message.role == 'assistant' %}{{- '<|assistant|>\\n' + message.content }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)


def test_a_reply_whose_render_ends_with_nothing_is_trained_through_the_tag_that_ends_it():
    """GLM-4.5's reply-ending token (the next turn's `<|user|>`) was never trained, so a draft never learnt where a
    reply stops: it is now trained after the last reply as after every other."""
    from transformers import AutoTokenizer

    from tests.targets import base_tokenizer_dir

    tokenizer = AutoTokenizer.from_pretrained(base_tokenizer_dir())
    tokenizer.add_special_tokens({"additional_special_tokens": ["[gMASK]", "<sop>", "<|user|>", "<|assistant|>"]})
    tokenizer.chat_template = GLM45
    chat = Chat(tokenizer)
    report = SkipReport()
    turns = [m for m in TWO_TURNS if m["role"] != "system"]
    samples = render(Conversation("c", tuple(turns), "c:1"), chat, 4096, "truncate", report)
    assert report.total == 0
    trained = [tokenizer.decode(s.input_ids[a:b]) for s in samples for a, b in masked_runs(s)]
    assert trained == [f"{m['content']}<|user|>" for m in turns if m["role"] == "assistant"]


# EXAONE-4.0's style: `[|role|]\n` tags, reasoning kept only after the last user turn, and a generation prompt that
# opens a think block when thinking is on (its default)
EXAONE4 = (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}{{- '[|system|]\\n' + m.content + '[|endofturn|]\\n' }}"
    "{%- elif m.role == 'user' %}{{- '[|user|]\\n' + m.content + '[|endofturn|]\\n' }}"
    "{%- elif m.role == 'assistant' %}{{- '[|assistant|]\\n' }}"
    "{%- set content = m.content %}{%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' %}"
    "{%- if '</think>' in content %}{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip() %}"
    "{%- set content = content.split('</think>')[-1].strip() %}{%- endif %}"
    "{%- if reasoning and loop.index0 > ns.last_query %}"
    "{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- content + '[|endofturn|]\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '[|assistant|]\\n' }}"
    "{%- if enable_thinking is not defined or enable_thinking %}{{- '<think>\\n' }}"
    "{%- else %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def test_exaone4_style_trains_each_reply_and_its_reasoning_and_no_tag_or_user_text():
    """The engine's prompt opens a think block the history render does not have: a reasoned reply is trained after
    that prompt (reasoning, `</think>`, reply, `[|endofturn|]`), a plain one after the tag as history renders it;
    never the assistant tag twice nor the user's turn, and nothing is refused."""
    from transformers import AutoTokenizer

    from tests.targets import base_tokenizer_dir

    tokenizer = AutoTokenizer.from_pretrained(base_tokenizer_dir())
    tags = ["[|system|]", "[|user|]", "[|assistant|]", "[|endofturn|]", "<think>", "</think>"]
    tokenizer.add_special_tokens({"additional_special_tokens": tags})
    tokenizer.chat_template = EXAONE4
    chat = Chat(tokenizer)
    user = {"role": "user", "content": "Hi\nthere"}
    cases = {
        "plain": ([user, {"role": "assistant", "content": "Hello!"}], ["Hello![|endofturn|]"]),
        "reasoned": (
            [user, {"role": "assistant", "content": "Hello!", "reasoning": "Greet back."}],
            ["Greet back.\n</think>\n\nHello![|endofturn|]"],
        ),
        "two turns": (
            [user, {"role": "assistant", "content": "Hello!", "reasoning": "Greet."}, TWO_TURNS[3], TWO_TURNS[4]],
            ["Greet.\n</think>\n\nHello![|endofturn|]", "Why did the chicken cross the road?[|endofturn|]"],
        ),
    }
    for name, (messages, expected) in cases.items():
        report = SkipReport()
        samples = render(Conversation("c", tuple(messages), "c:1"), chat, 4096, "truncate", report)
        trained = [tokenizer.decode(s.input_ids[a:b]) for s in samples for a, b in masked_runs(s)]
        assert trained == expected, name
        assert report.total == 0, (name, report.examples)
