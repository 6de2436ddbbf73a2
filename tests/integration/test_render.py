"""The assistant-only loss mask, checked on the real SmolLM2 chat template."""

import pytest

from speculators_train.data.chat import Chat
from speculators_train.data.conversations import Conversation, SkipReport, normalize_record
from speculators_train.data.mix import load_mix
from speculators_train.data.render import render, render_many
from speculators_train.schema import Section
from tests.conftest import SHAREGPT


def masked_runs(sample, tokenizer) -> list[str]:
    """Decode each contiguous run of loss-masked tokens."""
    runs, current = [], []
    for token, on in zip(sample.input_ids.tolist(), sample.loss_mask.tolist(), strict=True):
        if on:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    if current:
        runs.append(tokenizer.decode(current))
    return runs


def expected_runs(conv: Conversation, eot: str) -> list[str]:
    return [m["content"] + eot for m in conv.messages if m["role"] == "assistant"]


def test_mask_covers_exactly_assistant_content_and_end_of_turn_sharegpt(tokenizer, tmp_path):
    mix = tmp_path / "mix.yaml"
    mix.write_text(f"sources: [{{name: sg, path: '{SHAREGPT}', max_records: 40}}]\n")
    convs = load_mix(mix, 0.0).train
    report = SkipReport()
    checked = 0
    for conv in convs:
        samples = render(conv, Chat(tokenizer), 100_000, "truncate", report)
        if not samples:
            continue
        (sample,) = samples  # ChatML renders a conversation as its turns' prompts and replies: one sample
        assert masked_runs(sample, tokenizer) == expected_runs(conv, "<|im_end|>"), conv.origin
        checked += 1
    assert checked >= 35


def one(samples: list):
    """The single sample of a record (ChatML: one per conversation), None for none."""
    assert len(samples) <= 1
    return samples[0] if samples else None


def test_truncated_samples_are_prefixes_of_the_whole_in_one_batched_call(tokenizer, tmp_path):
    """Truncation stops rendering turns past the cut; ids and mask must still be exactly the whole's prefix, and every
    token the whole trains on within the first max_length must be in it (what follows the last trained turn, the
    start of a user turn past the cut, is left out)."""
    mix = tmp_path / "mix.yaml"
    mix.write_text(f"sources: [{{name: sg, path: '{SHAREGPT}', max_records: 60}}]\n")
    convs = load_mix(mix, 0.0).train
    chat = Chat(tokenizer)
    whole = [one(s) for s in render_many(convs, chat, 100_000, "truncate", SkipReport())]
    multi_turn_cuts = 0
    for max_length in (48, 200, 700):
        cut = [one(s) for s in render_many(convs, chat, max_length, "truncate", SkipReport())]
        for conv, full, part in zip(convs, whole, cut, strict=True):
            if full is None or part is None:
                assert part is None or full is not None, conv.origin
                continue
            n = len(part.input_ids)
            assert n <= min(max_length, len(full.input_ids)), conv.origin
            assert part.input_ids.tolist() == full.input_ids[:n].tolist(), conv.origin
            assert part.loss_mask.tolist() == full.loss_mask[:n].tolist(), conv.origin
            assert not full.loss_mask[n:max_length].any(), conv.origin
            multi_turn_cuts += n < len(full.input_ids) and len(conv.messages) > 2
    assert multi_turn_cuts >= 20


def test_mask_excludes_header_system_and_user_ultrachat_style(tokenizer):
    record = {
        "prompt_id": "p1",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another?"},
            {"role": "assistant", "content": "Green, or red."},
        ],
    }
    conv = normalize_record(record, "uc", "uc.jsonl:1", SkipReport())
    (sample,) = render(conv, Chat(tokenizer), 4096, "truncate", SkipReport())
    assert masked_runs(sample, tokenizer) == ["Blue.<|im_end|>", "Green, or red.<|im_end|>"]
    header = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    ids = sample.input_ids.tolist()
    starts = [i for i in range(len(ids)) if ids[i : i + len(header)] == header]
    assert len(starts) == 2
    for s in starts:
        assert not sample.loss_mask[s : s + len(header)].any()
        assert sample.loss_mask[s + len(header)]


@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_over_long_samples_are_truncated_or_dropped(tokenizer, overlong):
    conv = Conversation(
        "t:1", ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "word " * 300}), "x:1"
    )
    report = SkipReport()
    samples = render(conv, Chat(tokenizer), 64, overlong, report)
    if overlong == "truncate":
        (sample,) = samples
        assert len(sample.input_ids) == 64 and sample.loss_mask[-1] and report.total == 0
    else:
        assert samples == [] and report.counts["overlong"] == 1 and "x:1" in report.examples["overlong"][0]


def test_no_assistant_tokens_left_after_truncation_is_a_counted_skip(tokenizer):
    conv = Conversation(
        "t:2", ({"role": "user", "content": "long " * 200}, {"role": "assistant", "content": "ok"}), "y:3"
    )
    report = SkipReport()
    assert render(conv, Chat(tokenizer), 32, "truncate", report) == []
    assert report.counts == {"no_assistant_tokens_in_max_length": 1}


def test_template_error_is_a_counted_skip(tokenizer):
    class Strict:
        def apply_chat_template(self, *args, **kwargs):
            raise ValueError("Conversation roles must alternate user/assistant")

    report = SkipReport()
    conv = Conversation("t:3", ({"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}), "z:9")
    assert render(conv, Chat(Strict()), 32, "truncate", report) == []
    assert report.counts == {"chat_template_error": 1} and "alternate" in report.examples["chat_template_error"][0]


def test_resolve_pkg_path_names_missing_package():
    from speculators_train.errors import UserError

    with pytest.raises(UserError, match="package 'no_such_pkg' is not installed"):
        Section().resolve_path("pkg:no_such_pkg/x.json", "sources.x.path")


def long_records(convs: list[Conversation]) -> list[Conversation]:
    """Real conversations made far longer than any max_length below, and adversarial runs for the head's cut to
    fall in: one pre-token 100k characters long, whitespace and newline runs, emoji, special tokens written as text."""
    out = []
    for conv in convs[:12]:
        messages = tuple(
            {**m, "content": (m["content"] + "\n") * (50_000 // (len(m["content"]) + 1) + 1)} for m in conv.messages
        )
        out.append(Conversation(conv.id + ":long", messages, conv.origin))
    runs = ["#" * 100_000, " " * 100_000 + "x", "a" * 100_000, "\n" * 100_000, "🙂" * 100_000, "<|im_end|>" * 10_000]
    runs += ["Déjà vu, 1234567890 " * 5_000, "".join(chr(0x4E00 + i % 2000) for i in range(100_000))]
    for n, run in enumerate(runs):
        for first in (True, False):  # the long text in the user turn (cut there) or in the reply
            user, reply = (run, "Short reply.") if first else ("Please repeat.", run)
            messages = ({"role": "user", "content": user}, {"role": "assistant", "content": reply})
            out.append(Conversation(f"adv:{n}:{first}", messages, f"adv:{n}"))
    return out


def test_long_records_tokenised_by_their_head_match_the_whole(tokenizer, tmp_path, monkeypatch):
    """A text far past max_length is tokenised by its head alone (bounded memory); ids, loss mask and the drop
    decision must be exactly what tokenising the whole text gives."""
    import speculators_train.data.render as render_module

    mix = tmp_path / "mix.yaml"
    mix.write_text(f"sources: [{{name: sg, path: '{SHAREGPT}', max_records: 40}}]\n")
    convs = long_records([c for c in load_mix(mix, 0.0).train if len(c.messages) >= 2])
    heads = []
    head_tokens = render_module._head_tokens
    monkeypatch.setattr(render_module, "_head_tokens", lambda *a: heads.append(a[1]) or head_tokens(*a))
    chat = Chat(tokenizer)
    whole = [one(s) for s in render_many(convs, chat, 10**9, "truncate", SkipReport())]
    assert not heads and all(s is not None for s in whole), "the whole path: one batched call, no heads"
    compared = 0
    for max_length in (48, 127, 300):
        heads.clear()
        cut = [one(s) for s in render_many(convs, chat, max_length, "truncate", SkipReport())]
        dropped = [one(s) for s in render_many(convs, chat, max_length, "drop", SkipReport())]
        # a record whose prompt alone fills max_length has no sample text to tokenise; the others take the head
        assert len(heads) >= len(convs) // 2, "records here must take the head path"
        for conv, full, part, kept in zip(convs, whole, cut, dropped, strict=True):
            assert kept is None, conv.id  # all far over max_length
            if part is None:
                assert full is None or not full.loss_mask[:max_length].any(), conv.id
                continue
            assert part.input_ids.tolist() == full.input_ids[:max_length].tolist(), conv.id
            assert part.loss_mask.tolist() == full.loss_mask[:max_length].tolist(), conv.id
            compared += 1
    assert compared >= 40, compared
