"""Response regeneration replaces assistant turns with the real target's own greedy replies."""

from pathlib import Path

import pytest
import torch

from speculators_train.data.chat import Chat
from speculators_train.data.config import RegenerateConfig
from speculators_train.data.conversations import Conversation
from speculators_train.data.regenerate import regenerate


def greedy_reply(target, messages, max_new_tokens):
    tok = target.tokenizer
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = target.model.generate(
            **prompt, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id
        )
    return tok.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True).strip()


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
    (out,) = regenerate([conv], target.model, Chat(target.tokenizer), cfg, max_length=512, seed=0)
    first = greedy_reply(target, [conv.messages[0]], 8)
    assert out.messages[1] == {"role": "assistant", "content": first}
    second = greedy_reply(target, [conv.messages[0], out.messages[1], conv.messages[2]], 8)
    assert out.messages[3] == {"role": "assistant", "content": second}
    assert [m["role"] for m in out.messages] == ["user", "assistant", "user", "assistant"]
    assert out.id == conv.id


def test_prompt_past_max_length_ends_the_conversation(target):
    long = Conversation("t:2", ({"role": "user", "content": "word " * 100}, {"role": "assistant", "content": "x"}), "y")
    short = Conversation("t:3", ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x"}), "z")
    cfg = RegenerateConfig(enabled=True, max_new_tokens=4, batch_size=2)
    out = regenerate([long, short], target.model, Chat(target.tokenizer), cfg, max_length=32, seed=0)
    assert [m["role"] for m in out[0].messages] == ["user"], "no reply generated past max_length"
    assert out[1].messages[1]["content"] != "x"


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
    (out,) = regenerate([conv], target.model, Chat(target.tokenizer), cfg, max_length=512, seed=0)
    assert [m["role"] for m in out.messages] == ["system", "user", "assistant"]
    assert out.messages[2]["content"] != "ORIGINAL"


def test_max_turns_keeps_only_the_first_exchanges(target):
    turns = ({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "A"}) * 3
    cfg = RegenerateConfig(enabled=True, max_new_tokens=4, batch_size=1, max_turns=1)
    (out,) = regenerate([Conversation("t:5", turns, "v")], target.model, Chat(target.tokenizer), cfg, 512, 0)
    assert [m["role"] for m in out.messages] == ["user", "assistant"]


def test_llamacpp_regeneration_needs_a_gguf_target(tmp_path):
    from speculators_train.errors import UserError
    from speculators_train.recipe import load_recipe
    from tests.conftest import SHAREGPT, make_recipe

    path = make_recipe(tmp_path, [{"name": "sharegpt", "path": SHAREGPT, "max_records": 8}])
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    overrides = {"data.regenerate.enabled": True, "data.regenerate.engine": "llama.cpp"}
    gguf = {**overrides, "target.name_or_path": "smollm2-135m-instruct"}  # the embedded default is a GGUF file
    assert load_recipe(path, gguf).data.regenerate.engine == "llama.cpp"
    with pytest.raises(UserError, match=r"data\.regenerate\.engine 'llama\.cpp': target .* is not a GGUF file"):
        load_recipe(path, {**overrides, "target.name_or_path": str(hf_dir)})


@pytest.fixture(scope="module")
def small_lm(target, tmp_path_factory):
    """A real smaller LM with the target's tokenizer: the target's layers 0-1 and its head, saved as a model folder
    (what a standalone draft's `hf` export is)."""
    from transformers import AutoModelForCausalLM

    from speculators_train.origin import resolve_origin
    from speculators_train.recipe import TargetConfig

    where = tmp_path_factory.mktemp("small_lm")
    model = AutoModelForCausalLM.from_pretrained(resolve_origin(TargetConfig())[0], dtype=torch.float32)
    model.model.layers = model.model.layers[:2]
    model.config.num_hidden_layers = 2
    model.save_pretrained(where)
    target.tokenizer.save_pretrained(where)
    return where, model.eval()


def test_on_policy_replies_come_from_the_named_model_and_the_states_from_the_target(target, small_lm, tmp_path):
    """`data.regenerate.model`: the named model writes each reply (DistillSpec's on-policy data), the stored states
    are still the target's over that text."""
    from speculators_train.data.splits import load_splits
    from speculators_train.hidden_states.pipeline import process_chunk
    from speculators_train.recipe import load_recipe
    from tests.conftest import SHAREGPT, make_recipe

    where, model = small_lm
    regen = {"enabled": True, "max_new_tokens": 12, "batch_size": 2, "max_turns": 1, "model": str(where)}
    sources = [{"name": "sharegpt", "path": SHAREGPT, "max_records": 8}]
    recipe = load_recipe(make_recipe(tmp_path, sources, data={"regenerate": regen}))
    chunk = load_splits(recipe).train[:2]
    samples = process_chunk(recipe, target, chunk, 0).samples
    assert samples
    for sample in samples:
        ids = sample["input_ids"]
        reply_at = int(sample["loss_mask"].nonzero()[0])
        prompt = ids[None, :reply_at]
        with torch.no_grad():
            mine = model.generate(
                prompt, max_new_tokens=12, do_sample=False, pad_token_id=target.tokenizer.eos_token_id
            )
            theirs = target.model.generate(
                prompt, max_new_tokens=12, do_sample=False, pad_token_id=target.tokenizer.eos_token_id
            )
        decode = target.tokenizer.decode
        small_reply = decode(mine[0, reply_at:], skip_special_tokens=True).strip()
        assert small_reply != decode(theirs[0, reply_at:], skip_special_tokens=True).strip()
        assert small_reply in decode(ids[reply_at:], skip_special_tokens=True)
        with torch.no_grad():
            ref = target.model(ids[None], output_hidden_states=True).hidden_states[-1][0]
        final = target.final_norm(sample["hidden_state"])
        torch.testing.assert_close(final, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


def test_a_replying_model_needs_the_targets_tokenizer_and_a_float_engine(target, small_lm, tmp_path):
    from transformers import AutoTokenizer

    from speculators_train.data.regenerate import check_replying_tokenizer
    from speculators_train.errors import UserError
    from speculators_train.recipe import load_recipe
    from tests.conftest import SHAREGPT, make_recipe

    other = tmp_path / "other"
    tok = AutoTokenizer.from_pretrained(small_lm[0])
    tok.add_tokens(["<not-the-targets>"])
    tok.save_pretrained(other)
    for name in ("config.json", "model.safetensors"):
        (other / name).symlink_to(Path(small_lm[0]) / name)
    check_replying_tokenizer(str(small_lm[0]), target.tokenizer)
    with pytest.raises(UserError, match=r"data\.regenerate\.model '.*other': its tokenizer is not the target's"):
        check_replying_tokenizer(str(other), target.tokenizer)
    with pytest.raises(UserError, match=r"missing|data\.regenerate\.model"):
        check_replying_tokenizer(str(tmp_path / "nowhere"), target.tokenizer)
    path = make_recipe(tmp_path, [{"name": "sharegpt", "path": SHAREGPT, "max_records": 8}])
    overrides = {"data.regenerate.enabled": True, "data.regenerate.model": str(small_lm[0])}
    assert load_recipe(path, overrides).data.regenerate.model == str(small_lm[0])
    with pytest.raises(UserError, match=r"data\.regenerate\.model .*: engine 'llama\.cpp' replies from the target"):
        load_recipe(path, {**overrides, "data.regenerate.engine": "llama.cpp"})


def test_vllm_regeneration_starts_one_engine_per_rank_for_every_chunk(tmp_path, monkeypatch, capsys):
    """A vLLM start costs a minute or more: `generate` opens one replying engine for all of a rank's chunks (here
    three shards). What vLLM replies is `tests/test_vllm.py`'s; the engine here stands in for it and answers each
    request with one fixed sentence, since only how many engines start is at stake."""
    import speculators_train.data.regenerate as regenerate_module
    from speculators_train.cli import main
    from tests.conftest import SHAREGPT, make_recipe

    starts = []

    class Replies:
        def __init__(self, model, max_length, seed):
            starts.append(model)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def generate(self, ids, caps, temperature, top_p, seeds):
            from types import SimpleNamespace

            reply = [*tokenizer("Sure, here it is.")["input_ids"], tokenizer.convert_tokens_to_ids("<|im_end|>")]
            return SimpleNamespace(completions=[SimpleNamespace(tokens=reply) for _ in ids])

    from speculators_train.recipe import TargetConfig
    from speculators_train.target import load_tokenizer

    tokenizer = load_tokenizer(TargetConfig())
    monkeypatch.setattr(regenerate_module, "replying_engine", Replies)
    monkeypatch.setattr("speculators_train.hidden_states.generator.replying_engine", Replies)
    sources = [{"name": "sharegpt", "path": SHAREGPT, "max_records": 12}]
    recipe = make_recipe(
        tmp_path, sources, data={"regenerate": {"enabled": True, "engine": "vllm", "max_new_tokens": 4}}
    )
    with pytest.raises(SystemExit) as done:
        main(["generate", str(recipe)])
    assert not done.value.code, capsys.readouterr().err
    assert len(starts) == 1, starts
