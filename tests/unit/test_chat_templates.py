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
