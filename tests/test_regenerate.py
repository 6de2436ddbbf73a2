"""Response regeneration replaces assistant turns with the real target's own greedy replies."""

import pytest
import torch

from speculators_train.data.conversations import Conversation
from speculators_train.data.regenerate import regenerate
from speculators_train.recipe import RegenerateConfig


def greedy_reply(target, messages, max_new_tokens):
    tok = target.tokenizer
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = target.model.generate(
            **prompt, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id
        )
    return tok.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True).strip()


@pytest.mark.slow
def test_multi_turn_regeneration_conditions_on_regenerated_turns(target):
    conv = Conversation(
        "t:1",
        (
            {"role": "user", "content": "Name a fruit."},
            {"role": "assistant", "content": "ORIGINAL ONE"},
            {"role": "user", "content": "And a vegetable?"},
            {"role": "assistant", "content": "ORIGINAL TWO"},
        ),
        "x:1",
    )
    cfg = RegenerateConfig(enabled=True, max_new_tokens=8, batch_size=1)
    (out,) = regenerate([conv], target.model, target.tokenizer, cfg, max_length=512, seed=0)
    first = greedy_reply(target, [conv.messages[0]], 8)
    assert out.messages[1] == {"role": "assistant", "content": first}
    second = greedy_reply(target, [conv.messages[0], out.messages[1], conv.messages[2]], 8)
    assert out.messages[3] == {"role": "assistant", "content": second}
    assert [m["role"] for m in out.messages] == ["user", "assistant", "user", "assistant"]
    assert out.id == conv.id


@pytest.mark.slow
def test_prompt_past_max_length_ends_the_conversation(target):
    long = Conversation("t:2", ({"role": "user", "content": "word " * 100}, {"role": "assistant", "content": "x"}), "y")
    short = Conversation("t:3", ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x"}), "z")
    cfg = RegenerateConfig(enabled=True, max_new_tokens=4, batch_size=2)
    out = regenerate([long, short], target.model, target.tokenizer, cfg, max_length=32, seed=0)
    assert [m["role"] for m in out[0].messages] == ["user"], "no reply generated past max_length"
    assert out[1].messages[1]["content"] != "x"


@pytest.mark.slow
def test_replies_before_any_user_turn_are_dropped_not_a_crash(target):
    """Real ShareGPT records open with the model speaking; there is no prompt to regenerate that turn from."""
    conv = Conversation(
        "t:4",
        (
            {"role": "system", "content": "Be brief."},
            {"role": "assistant", "content": "Hello! How can I help?"},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "ORIGINAL"},
        ),
        "w",
    )
    cfg = RegenerateConfig(enabled=True, max_new_tokens=4, batch_size=1)
    (out,) = regenerate([conv], target.model, target.tokenizer, cfg, max_length=512, seed=0)
    assert [m["role"] for m in out.messages] == ["system", "user", "assistant"]
    assert out.messages[2]["content"] != "ORIGINAL"


@pytest.mark.slow
def test_max_turns_keeps_only_the_first_exchanges(target):
    turns = ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "A"}) * 3
    cfg = RegenerateConfig(enabled=True, max_new_tokens=4, batch_size=1, max_turns=1)
    (out,) = regenerate([Conversation("t:5", turns, "v")], target.model, target.tokenizer, cfg, 512, seed=0)
    assert [m["role"] for m in out.messages] == ["user", "assistant"]
