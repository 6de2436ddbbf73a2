"""Exports proven by the clients that read them: the `speculators` library's own Eagle3DraftModel on our
speculators-format export, SGLang's LlamaForCausalLMEagle3 loading rules on our SGLang export, and the round trip
export -> import -> speculative decoding with the session target."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from speculators_train.errors import UserError
from speculators_train.export.run import export
from speculators_train.families import get
from speculators_train.families.eagle.model import Eagle3Config, Eagle3Draft
from speculators_train.families.eagle3.proposer import Eagle3Proposer
from speculators_train.families.vocab import build_vocab_mapping, draft_to_target
from speculators_train.proposal import Sampling
from speculators_train.recipe import load_recipe
from speculators_train.training.checkpoint import save_checkpoint
from speculators_train.verify.decoder import SpeculativeDecoder
from speculators_train.verify.report import acceptance
from speculators_train.verify.run import eos_ids, load_draft_for
from tests.conftest import QUESTIONS, SHAREGPT, chat, make_recipe


def random_draft(target, **norms: bool) -> Eagle3Draft:
    """The real EAGLE-3 architecture for the session target with random weights and a 1024-id vocabulary of
    scattered ids (so d2t offsets are not all equal); random weights make every weight matter to the drafted tokens.
    `norms`: EAGLE-3.1's norm_before_fc / norm_output."""
    torch.manual_seed(0)
    config = Eagle3Config.for_target(target.config, target.aux_layer_ids, 1024, False, **norms)
    model = Eagle3Draft(config)
    freq = torch.zeros(target.vocab_size)
    freq[torch.randperm(target.vocab_size)[:1024]] = 1
    d2t, t2d = build_vocab_mapping(freq, 1024)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # norms: random too, so a norm loaded into the wrong slot shows
                p.uniform_(0.5, 1.5)
        model.d2t.copy_(d2t)
        model.t2d.copy_(t2d)
        model.embed_tokens.weight.copy_(target.embed_tokens.weight)
    return model.eval()


@pytest.fixture(scope="module")
def draft(target):
    return random_draft(target)


@pytest.fixture
def setup(tmp_path, draft):
    """(recipe, checkpoint dir) in tmp_path, for the real embedded target."""
    recipe = load_recipe(make_recipe(tmp_path, [{"name": "sharegpt", "path": SHAREGPT, "max_records": 8}]))
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, draft, None, {"step": 1}, keep_last=1)
    return recipe, checkpoint


@pytest.mark.parametrize(
    "norms",
    [{}, {"norm_before_fc": True}, {"norm_before_fc": True, "norm_output": True}],
    ids=["eagle3", "norm_before_fc", "eagle3.1"],
)
def test_speculators_library_loads_our_export_and_computes_the_same_draft_logits(tmp_path, target, norms):
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    from speculators_train.origin import resolve_origin

    draft = random_draft(target, **norms)
    recipe = load_recipe(make_recipe(tmp_path, [{"name": "sharegpt", "path": SHAREGPT, "max_records": 8}]))
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, draft, None, {"step": 1}, keep_last=1)
    out = export(recipe, checkpoint, "speculators", tmp_path / "spec", "float32").path
    config = Eagle3SpeculatorConfig.from_pretrained(out)
    assert config.speculators_config.verifier.name_or_path == resolve_origin(recipe.target)[0]
    config.transformer_layer_config._attn_implementation = "sdpa"
    theirs = Eagle3DraftModel.from_pretrained(out, config=config).eval()

    file_names = set(load_file(out / "model.safetensors"))
    their_names = set(theirs.state_dict())
    assert their_names - file_names == {"verifier_norm.weight", "verifier_lm_head.weight"}
    assert file_names - their_names == set()
    assert not any(p.isnan().any() for p in theirs.parameters())  # their init is NaN until a weight loads
    assert theirs.config.eagle_aux_hidden_state_layer_ids == draft.config.aux_layer_ids
    written = json.loads((out / "config.json").read_text())
    for flag in ("norm_before_fc", "norm_output"):  # vLLM builds input_norm / feeds back post-norm from these keys
        assert written[flag] is getattr(theirs.config, flag) is norms.get(flag, False)
    assert ("input_norm.weight" in file_names) is norms.get("norm_before_fc", False)

    ids = chat(target, QUESTIONS[0])
    aux, _ = target.hidden_states(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
    tokens, hidden = torch.tensor([ids[1:]]), aux[:, :-1]  # (x_{j+1}, g_j), as the verify loop feeds them
    positions = torch.arange(1, len(ids))[None]
    steps = 3
    captured = []
    hook = theirs.lm_head.register_forward_hook(lambda _m, _a, out: captured.append(out.detach()))
    with torch.no_grad():
        theirs(hidden, tokens, torch.zeros_like(tokens), position_ids=positions.clone(), ttt_steps=steps)
        mine = draft.ttt_forward(tokens, hidden, positions, steps)
    hook.remove()
    assert len(captured) == steps
    for i in range(steps):  # TTT steps too: masks, RoPE offsets and token shifts agree
        torch.testing.assert_close(captured[i], mine[i], rtol=1e-4, atol=1e-4)


def test_export_writes_the_chosen_float_dtype_and_keeps_vocab_maps_integer(tmp_path, draft, setup):
    recipe, checkpoint = setup
    out = export(recipe, checkpoint, "speculators", tmp_path / "bf16").path
    with safe_open(out / "model.safetensors", framework="pt") as fh:
        dtypes = {name: fh.get_slice(name).get_dtype() for name in fh.keys()}  # noqa: SIM118
    assert dtypes.pop("d2t") == "I64" and dtypes.pop("t2d") == "BOOL"
    assert set(dtypes.values()) == {"BF16"}
    config = json.loads((out / "config.json").read_text())
    assert "model_type" not in config and config["norm_before_residual"] is False
    assert (
        config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == recipe.eval.num_speculative_tokens
    )
    assert (out / "tokenizer.json").is_file() and (out / "README.md").is_file()
    assert torch.equal(load_file(out / "model.safetensors")["d2t"], draft.d2t)


class Recording(Eagle3Proposer):
    """Keeps every chain the draft proposes, so two drafts can be compared step by step."""

    def __init__(self, draft) -> None:
        super().__init__(draft, get("eagle3").states(draft.config))
        self.chains: list[list[int]] = []

    def propose_chain(self, k, sampling, generator):
        tokens, q = super().propose_chain(k, sampling, generator)
        self.chains.append(tokens)
        return tokens, q


@pytest.mark.parametrize("fmt", ["speculators", "sglang"])
def test_export_import_verify_round_trip_drafts_and_accepts_exactly_like_the_draft_in_memory(
    tmp_path, target, draft, setup, fmt
):
    recipe, checkpoint = setup
    out = export(recipe, checkpoint, fmt, tmp_path / fmt, "float32").path
    loaded = load_draft_for(target, out)
    imported = loaded.draft
    assert loaded.path == out and imported.config.aux_layer_ids == draft.config.aux_layer_ids
    results = []
    for model in (draft, imported):
        proposer = Recording(model)
        decoder = SpeculativeDecoder(target, proposer, Sampling(), 5, None)
        accepted, tokens = [], []
        for question in QUESTIONS:
            gen = decoder.generate(chat(target, question), 24, eos_ids(target), None)
            accepted += gen.accepted
            tokens.append(gen.tokens)
        results.append((proposer.chains, acceptance(accepted, 5)["acceptance_length"], tokens))
    (chains, al, tokens), (chains2, al2, tokens2) = results
    assert len(chains) > 20 and chains2 == chains
    assert al2 == al and tokens2 == tokens


def test_sglang_export_has_the_names_and_config_sglangs_eagle3_loader_reads(tmp_path, draft, setup):
    """Follows sgl-project/sglang python/sglang/srt/models/llama_eagle3.py: `LlamaForCausalLMEagle3.__init__` (its
    parameters: model.embed_tokens, model.fc [H, 3*target_hidden], model.midlayer.* with fused qkv_proj and
    gate_up_proj over a 2H input, model.norm, lm_head [draft_vocab, H], untied unless tie_word_embeddings) and
    `load_weights` (d2t -> hot_token_id = d2t + arange, t2d skipped, q/k/v and gate/up stacked, a name not in the
    parameters is retried with a `model.` prefix and otherwise silently skipped); and llama.py
    `set_eagle3_layers_to_capture`, which captures `id + 1` for each id in eagle_config."""
    recipe, checkpoint = setup
    out = export(recipe, checkpoint, "sglang", tmp_path / "sglang", "bfloat16").path
    config = json.loads((out / "config.json").read_text())
    weights = load_file(out / "model.safetensors")

    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["tie_word_embeddings"] is False and not config.get("bias", False)
    captured = [i + 1 for i in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    assert captured == draft.config.aux_layer_ids  # SGLang's capture rule lands on the states we trained on
    h, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    hd, inter, th = config["head_dim"], config["intermediate_size"], config["target_hidden_size"]
    assert config["rope_theta"] == draft.config.llama.rope_parameters["rope_theta"]
    params = {
        "model.embed_tokens.weight": (config["vocab_size"], h),
        "model.fc.weight": (h, 3 * th),
        "model.midlayer.self_attn.qkv_proj.weight": ((heads + 2 * kv) * hd, 2 * h),
        "model.midlayer.self_attn.o_proj.weight": (h, heads * hd),
        "model.midlayer.mlp.gate_up_proj.weight": (2 * inter, h),
        "model.midlayer.mlp.down_proj.weight": (h, inter),
        "model.midlayer.input_layernorm.weight": (h,),
        "model.midlayer.hidden_norm.weight": (h,),
        "model.midlayer.post_attention_layernorm.weight": (h,),
        "model.norm.weight": (h,),
        "lm_head.weight": (config["draft_vocab_size"], h),
    }
    shards = {"q": heads * hd, "k": kv * hd, "v": kv * hd, 0: inter, 1: inter}
    stacked = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v")]
    stacked += [(".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1)]
    loaded: dict[str, list] = {name: [] for name in params}
    hot_token_id = None
    for name, tensor in weights.items():
        if "d2t" in name:
            hot_token_id = tensor + torch.arange(tensor.shape[0])
            continue
        if "t2d" in name:
            continue
        for param, shard_name, shard in stacked:
            if shard_name in name:
                full = name.replace(shard_name, param)
                full = full if full in params else f"model.{full}"
                assert full in params, f"{name} would be skipped by SGLang"
                assert tensor.shape == (shards[shard], params[full][1]), name
                loaded[full].append(shard)
                break
        else:
            full = name if name in params else f"model.{name}"
            assert full in params, f"{name} would be skipped by SGLang"
            assert tuple(tensor.shape) == params[full], name
            loaded[full].append(None)
    assert sorted(loaded.pop("model.midlayer.self_attn.qkv_proj.weight")) == ["k", "q", "v"]
    assert sorted(loaded.pop("model.midlayer.mlp.gate_up_proj.weight")) == [0, 1]
    assert all(got == [None] for got in loaded.values()), loaded  # every other parameter loaded exactly once
    assert torch.equal(hot_token_id, draft_to_target(draft.d2t))


def test_sglang_refuses_a_draft_it_would_run_wrong_and_writes_nothing(tmp_path, target):
    recipe = load_recipe(make_recipe(tmp_path, [{"name": "sharegpt", "path": SHAREGPT, "max_records": 8}]))
    model = Eagle3Draft(Eagle3Config.for_target(target.config, target.aux_layer_ids, 64, True))
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, model, None, {"step": 1}, keep_last=1)
    with pytest.raises(UserError, match="norm_before_residual is true, but SGLang"):
        export(recipe, checkpoint, "sglang", tmp_path / "out")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp*"))
    assert export(recipe, checkpoint, "speculators", tmp_path / "out").path.is_dir()  # vLLM reads the flag


def test_export_against_another_target_names_the_mismatch_and_never_overwrites_without_force(tmp_path, target, setup):
    from transformers import LlamaConfig

    recipe, checkpoint = setup
    other = LlamaConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
    small = save_checkpoint(
        tmp_path / "a", 1, Eagle3Draft(Eagle3Config.for_target(other, [1, 2, 3], 64, False)), None, {}, 1
    )
    with pytest.raises(UserError, match=r"hidden size: draft 64, target 128; vocab size: draft 32000, target 49152"):
        export(recipe, small, "speculators", tmp_path / "x")
    deeper = LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": 32})
    deep = save_checkpoint(
        tmp_path / "b", 1, Eagle3Draft(Eagle3Config.for_target(deeper, [2, 16, 29], 64, False)), None, {}, 1
    )
    with pytest.raises(UserError, match=r"layer count: draft trained on 32, target has 8"):
        export(recipe, deep, "speculators", tmp_path / "x")

    out = tmp_path / "x"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    with pytest.raises(UserError, match="already exists; pass --force"):
        export(recipe, checkpoint, "speculators", out)
    assert (out / "mine.txt").read_text() == "keep"
    with pytest.raises(UserError, match="is not an export of this toolkit; --force replaces only a previous export"):
        export(recipe, checkpoint, "speculators", out, force=True)
    assert (out / "mine.txt").read_text() == "keep"


def test_export_command_prints_the_serve_line_and_the_card_reports_measured_acceptance(tmp_path, capsys, setup):
    from speculators_train.cli import main

    recipe, checkpoint = setup
    report = recipe.run_dir / "verify" / "20261121-000000"
    report.mkdir(parents=True)
    record = {"suite": "sharegpt-held-out", "shape": "chain(K=5)", "temperature": 0.0, "acceptance_length": 2.25}
    record.update(num_speculative_tokens=5, steps=8, per_position_acceptance=[0.5, 0.3, 0.2, 0.15, 0.1])
    record.update(speedup=1.5, device="cpu", checkpoint=str(checkpoint))
    (report / "results.json").write_text(json.dumps([record]))
    out = tmp_path / "sg"
    argv = ["export", str(recipe.source_path), "--checkpoint", str(checkpoint), "--format", "sglang", "--out", str(out)]
    with pytest.raises(SystemExit) as exit_code:
        main(argv)
    assert exit_code.value.code == 0
    printed = capsys.readouterr().out
    assert f"python -m sglang.launch_server --model-path {recipe.target.name_or_path}" in printed
    assert f"--speculative-draft-model-path {out} --speculative-num-steps 5" in printed
    card = (out / "README.md").read_text()
    assert "| sharegpt-held-out | chain(K=5) | 0.0 | 2.25 | 1.50x |" in card
    assert "written as [1, 3, 4] in `eagle_config`" in card
    with pytest.raises(SystemExit) as exit_code:
        main(argv)  # the directory exists now
    assert exit_code.value.code == 2
