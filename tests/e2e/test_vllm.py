"""vLLM as a real engine: every family vLLM serves is loaded by vLLM's own code from the files `export` writes, and
decodes with the target's own greedy output, accepting drafts. One engine start per family, eager, a small KV cache,
its engine core in this process (`in_process`: seconds to start instead of two spawned processes importing vLLM; the
spawned engine and its clean-up are proved by tests/e2e/test_signals.py and test_vllm_capture.py); the target-only
reference is decoded once for the module."""

import json
import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from speculators_train.engines.vllm.offline import Completion, Decoded, SpecCounts, spec_counts
from speculators_train.engines.vllm.verify import NGRAM, record, settings
from speculators_train.errors import UserError
from speculators_train.families import FAMILIES, get, settings_types
from speculators_train.families.drafts import load_draft
from speculators_train.recipe import load_recipe
from tests.conftest import REPO, SHAREGPT, make_recipe, sweep, tiny_config

MAX_NEW = 48


def test_counters_sum_over_engines_and_subtract_per_call():
    snapshot = [
        SimpleNamespace(name="vllm:spec_decode_num_drafts", value=10),
        SimpleNamespace(name="vllm:spec_decode_num_drafts", value=2),  # a second engine's label set
        SimpleNamespace(name="vllm:spec_decode_num_draft_tokens", value=36),
        SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=14),
        SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[8, 4]),
        SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[1, 0, 1]),
        SimpleNamespace(name="vllm:num_requests_running", value=3),
    ]
    now = spec_counts(snapshot)
    assert (now.drafts, now.draft_tokens, now.accepted, now.per_position) == (12, 36, 14, [9, 4, 1])
    call = now - SpecCounts(2, 6, 3, [2, 1])
    assert (call.drafts, call.accepted, call.per_position) == (10, 11, [7, 3, 1])
    assert call.acceptance_length == pytest.approx(1 + 11 / 10)
    assert call.per_position_rates(4) == [0.7, 0.3, 0.1, 0.0]
    assert (call + call).per_position == [14, 6, 2]


def test_a_record_counts_acceptance_identity_and_target_passes_as_vllm_reports_them():
    # Prompt 1: 4 verify steps at K = 2 accepting 2, 1, 0, 2 -> 1 + 4 + 5 = 10 tokens; prompt 2 forks at token 3
    # after one step accepting nothing.
    spec = Decoded([Completion(list(range(10)), 1.0), Completion([5, 6, 7, 9], 1.0)], 2.0, SpecCounts(5, 10, 5, [3, 2]))
    base = Decoded([Completion(list(range(10)), 2.0), Completion([5, 6, 7, 8], 2.0)], 4.0, SpecCounts())
    r = record("s", "draft", 2, 0.0, 1.0, 1, spec, base)
    assert r["acceptance_length"] == pytest.approx(2.0)
    assert r["per_position_acceptance"] == [pytest.approx(0.6), pytest.approx(0.4)]
    assert r["draft_acceptance_rate"] == pytest.approx(0.5)
    assert r["tokens_per_target_pass"] == pytest.approx((14 - 2) / (14 - 2 - 5))
    assert r["greedy_identical_outputs"] == "1/2" and r["first_divergence"] == [None, 3]
    assert r["speedup"] == pytest.approx((14 / 2) / (14 / 4))
    assert r["per_prompt_speedup_quartiles"][1] == pytest.approx(2.0)
    sampled = record("s", "ngram", 2, 1.0, 1.0, 2, spec, base)
    assert "greedy_identical_outputs" not in sampled and sampled["shape"] == "ngram(K=2)"
    # batched, the counts are the call's: no request's own AL; alone, each request's: AL 2.25 and 1.0
    assert r["acceptance_length_per_request_mean"] is None
    alone = [
        Completion(list(range(10)), 1.0, SpecCounts(4, 8, 5, [3, 2])),
        Completion([5, 6, 7, 9], 1.0, SpecCounts(1, 2, 0, [0])),
    ]
    one = record("s", "draft", 2, 0.0, 1.0, 1, Decoded(alone, 2.0, SpecCounts(5, 10, 5, [3, 2])), base)
    assert one["acceptance_length_per_request_mean"] == pytest.approx((2.25 + 1.0) / 2)
    assert one["acceptance_length"] == pytest.approx(2.0)  # pooled over the 5 steps


def test_settings_run_the_draft_at_each_k_and_ngram_at_the_first(tmp_path):
    recipe = load_recipe(
        make_recipe(
            tmp_path,
            [{"name": "sharegpt", "path": SHAREGPT, "max_records": 8}],
            eval={"engine": "vllm", "vllm": {"speculative_tokens": [2, 4]}},
        )
    )
    runs = settings(recipe, get("peagle").formats["speculators"], tmp_path / "x")
    assert [(m, k) for m, k, _ in runs] == [("draft", 2), ("draft", 4), ("ngram", 2)]
    assert runs[1][2] == {
        "model": str(tmp_path / "x"),
        "method": "eagle3",
        "parallel_drafting": True,
        "num_speculative_tokens": 4,
    }
    assert runs[2][2] == {"method": "ngram", "num_speculative_tokens": 2, **NGRAM}


def test_recipe_refuses_what_vllm_cannot_run(tmp_path, monkeypatch):
    sources = [{"name": "sharegpt", "path": SHAREGPT, "max_records": 8}]
    path = make_recipe(tmp_path, sources, eval={"engine": "vllm"})
    assert load_recipe(path).eval.engine == "vllm"
    with pytest.raises(UserError, match=r"eval\.engine 'vllm': vLLM drafts chains here"):
        load_recipe(path, {"eval.mode": "tree"})
    with pytest.raises(UserError, match=r"eval\.vllm\.speculative_tokens"):
        load_recipe(path, {"eval.vllm.speculative_tokens": [0]})
    with pytest.raises(UserError, match=r"eval\.engine 'vllm': vLLM serves no mlp draft"):
        load_recipe(path, {"draft": {"family": "mlp"}})
    assert load_recipe(path, {"draft": {"family": "draft_model"}}).eval.engine == "vllm"


@pytest.mark.parametrize("name", FAMILIES)
def test_the_format_a_family_names_for_vllm_is_the_one_that_gives_a_speculative_config(name, tmp_path):
    """The recipe refuses `eval.engine: vllm` from a declaration that imports nothing; a format's own
    `vllm_speculative_config` is what `verify --engine vllm` runs. The declared format is the family's first that
    vLLM serves (EAGLE-3's `gguf` export holds the speculators folder too), and a family that declares none has
    none."""
    family = get(name)
    served = [f for f, fmt in family.formats.items() if fmt.vllm_speculative_config(tmp_path, 1) is not None]
    assert served[:1] == ([] if family.settings.vllm_format is None else [family.settings.vllm_format])


def test_medusa_export_writes_full_vocabulary_heads_and_reads_back_the_trained_draft(tmp_path):
    from safetensors.torch import load_file

    from speculators_train.families.medusa.formats import load_medusa
    from speculators_train.families.medusa.model import MedusaConfig, MedusaDraft

    torch.manual_seed(0)
    config = MedusaConfig(hidden_size=8, num_heads=2, num_layers=1, draft_vocab_size=5, target_vocab_size=12)
    draft = MedusaDraft(config)
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_()
        draft.d2t.copy_(torch.tensor([1, 2, 2, 4, 6]))  # target ids 1, 3, 4, 7, 10
        draft.t2d.zero_()
        draft.t2d[torch.tensor([1, 3, 4, 7, 10])] = True
    family = get("medusa")
    cfg, weights = family.formats["speculators"].write(draft, "float32", "v", ["LlamaForCausalLM"], 2)
    # What vLLM 0.32's Medusa needs to build full-size heads and skip the token_map slicing it cannot load.
    assert cfg["truncated_vocab_size"] == cfg["vocab_size"] == 12 and cfg["original_lm_head"] is False
    head = weights["lm_heads.1.weight"]
    assert head.shape == (12, 8)
    assert torch.equal(head[[1, 3, 4, 7, 10]], draft.lm_heads[1].weight)
    assert not head[[0, 2, 5, 6, 8, 9, 11]].any()
    assert weights["token_map"].tolist() == [1, 3, 4, 7, 10]
    out = tmp_path / "medusa"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(cfg))
    from safetensors.torch import save_file

    save_file(weights, out / "model.safetensors")
    back = load_medusa(out, cfg)
    assert back.config.draft_vocab_size == 5
    assert torch.equal(back.d2t, draft.d2t)
    z = torch.randn(3, 8)
    assert torch.allclose(back(z), draft(z))
    # A full-size head with other rows not zero is what vLLM runs too: the map is ignored, nothing restricted.
    weights = load_file(out / "model.safetensors")
    weights["lm_heads.0.weight"][0] = 1.0
    save_file(weights, out / "model.safetensors")
    assert load_medusa(out, cfg).config.draft_vocab_size == 12


def test_an_engine_started_in_this_process_leaves_the_next_one_its_own_settings(monkeypatch):
    """vLLM's in-process engine core caches every variable it reads and freezes the heap: the next engine must still
    start with its own process mode and KV cache size, and the frozen objects must be collectable again."""
    import gc

    import vllm
    from vllm import envs

    from speculators_train.engines.vllm.offline import Engine

    seen = []

    def fake_llm(**kwargs):
        seen.append((envs.VLLM_ENABLE_V1_MULTIPROCESSING, envs.VLLM_CPU_KVCACHE_SPACE))
        if not envs.VLLM_ENABLE_V1_MULTIPROCESSING:  # what vLLM's engine core does when it starts here
            envs.enable_envs_cache()
            gc.freeze()
        return SimpleNamespace()

    monkeypatch.setattr(vllm, "LLM", fake_llm)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    try:
        with Engine(REPO, kv_cache_gib=1, in_process=True):
            pass
        assert gc.get_freeze_count() == 0
        with Engine(REPO, kv_cache_gib=2):
            pass
    finally:
        envs.disable_envs_cache()
        gc.unfreeze()
    assert seen == [(False, 1), (True, 2)]


# --- the real engine -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(target, tmp_path_factory):
    """vLLM's own target-only greedy output for the fitted prompt (one engine start for the module)."""
    from speculators_train.data.chat import Chat
    from speculators_train.engines.vllm.offline import Engine
    from speculators_train.origin import resolve_origin
    from speculators_train.verify.suites import chat_ids
    from tests.conftest import PROMPT

    prompt = chat_ids(Chat(target.tokenizer), PROMPT)
    hf_dir = resolve_origin(tiny_config())[0]
    with Engine(hf_dir, in_process=True) as engine:
        out = engine.generate([prompt], MAX_NEW, 0.0, 1.0, [0])
    return hf_dir, prompt, out.completions[0].tokens


def vllm_config(out):
    """vLLM's own reading of an export's config.json: its speculators config classes, or its MedusaConfig."""
    from vllm.transformers_utils.configs.medusa import MedusaConfig
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    model_type = json.loads((out / "config.json").read_text()).get("model_type")
    if model_type == "medusa":
        return MedusaConfig.from_pretrained(str(out))
    if model_type == "llama":  # a plain model folder (draft_model), read as vLLM reads any model's config
        from vllm.transformers_utils.config import get_config

        return get_config(str(out), trust_remote_code=False)
    return SpeculatorsConfig.from_pretrained(str(out))


def printed_speculative_config(capsys, argv: list[str]) -> dict:
    """Run `export` and return the speculative config of the `vllm serve ... --speculative-config` line it prints."""
    from speculators_train.cli import main

    with pytest.raises(SystemExit) as code:
        main(argv)
    assert code.value.code == 0
    printed = capsys.readouterr().out
    match = re.search(r"vllm serve \S+ --speculative-config '([^']+)'", printed)
    assert match, printed
    return json.loads(match.group(1))


@pytest.mark.parametrize(
    "family",
    [
        s.model_fields["family"].default
        for s in settings_types()
        if s.vllm_format and not s.vllm_needs_gpu and not s.vllm_mtp_classes  # MTP: not on a Llama target
    ],
)
def test_vllm_serves_each_family_from_the_printed_command_with_the_targets_output(
    family, target, reference, fitted, tmp_path, capsys
):
    """The export, the `vllm serve` line `export` prints, run offline as `LLM(speculative_config=...)`: vLLM loads
    the draft with its own code, accepts its drafts, and gives exactly its target-only greedy output."""
    from speculators_train.engines.vllm.offline import Engine

    hf_dir, prompt, alone = reference
    recipe, checkpoint, fitted_prompt, _ = fitted(family)
    assert fitted_prompt == prompt
    out = tmp_path / "export"
    argv = ["export", str(recipe.source_path), "--checkpoint", str(checkpoint), "--out", str(out), "--dtype", "float32"]
    spec = printed_speculative_config(capsys, argv)
    assert spec["model"] == str(out)
    assert load_draft(out, target.num_layers).family.name == family
    parsed = vllm_config(out)
    if family == "draft_model":
        assert (parsed.num_hidden_layers, parsed.vocab_size, parsed.tie_word_embeddings) == (2, 49152, False)
    elif family == "medusa":
        assert (parsed.num_heads, parsed.truncated_vocab_size, parsed.vocab_size) == (3, 49152, 49152)
    elif family == "dflash":  # the target captures our ids; the draft's own ids are one lower; blocks bidirectional
        assert parsed.architectures == ["DFlashDraftModel"] and parsed.draft_vocab_size == 512
        assert parsed.eagle_aux_hidden_state_layer_ids == target.aux_layer_ids
        ids = [i - 1 for i in target.aux_layer_ids]
        causal = {"sample_from_anchor": False, "causal": False}
        assert parsed.dflash_config == {"mask_token_id": 16, "target_layer_ids": ids, **causal}
        from vllm.model_executor.models.qwen3_dflash import dflash_has_any_non_causal

        assert dflash_has_any_non_causal(parsed)  # vLLM's own rule: the block runs bidirectionally, as trained
    else:
        assert parsed.eagle_aux_hidden_state_layer_ids == target.aux_layer_ids
        assert (parsed.draft_vocab_size, parsed.norm_before_residual) == (512, False)
        if family == "peagle":
            assert parsed.architectures == ["PeagleLlamaForCausalLM"] and parsed.pard_token == 16
    with Engine(hf_dir, spec, in_process=True) as engine:
        decoded = engine.generate([prompt], MAX_NEW, 0.0, 1.0, [0])
    assert decoded.completions[0].tokens == alone
    assert decoded.counts.drafts > 0 and decoded.counts.accepted > 0, decoded.counts


def read_as_trained(family: str, parsed: Any, draft: Any) -> str:
    """Assert vLLM's reading of a GPU-only export's own options (`parsed`) against the trained config; return the
    item its V1 model runner refuses."""
    if family == "dspark":
        assert parsed.architectures == ["Qwen3DSparkModel"]
        assert parsed.target_layer_ids == [i - 1 for i in draft.aux_layer_ids]
        assert (parsed.sample_from_anchor, parsed.dspark_bonus_anchor, parsed.block_size) == (True, False, 4)
        assert (parsed.markov_rank, parsed.markov_head_type) == (draft.markov_rank, "vanilla")
        assert parsed.enable_confidence_head is True and parsed.confidence_head_with_markov is True
        return "dspark speculative decoding"
    assert family == "dflash2", f"say what vLLM must read from a {family} export"
    assert parsed.architectures == ["DFlash2DraftModel"]
    options = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    assert {k: parsed.dflash_config[k] for k in options} == {k: getattr(draft, k) for k in options}
    assert parsed.dflash_config["target_layer_ids"] == [i - 1 for i in draft.aux_layer_ids]
    assert parsed.dflash_config["sample_from_anchor"] is False
    return "DFlash candidate-head drafts"


@pytest.mark.parametrize(
    "family", [s.model_fields["family"].default for s in settings_types() if s.vllm_format and s.vllm_needs_gpu]
)
def test_vllm_reads_a_gpu_only_export_as_trained_and_its_cpu_build_stops_where_it_says(
    family, target, reference, fitted, tmp_path, capsys
):
    """DSpark and DFlash2: vLLM's speculators reader and model registry take our export (its draft class, the aux
    ids, the family's options as written, blocks bidirectional), and this CPU build stops at its own rule: the V1
    model runner refuses the method (DSpark) or the candidate head (DFlash2), and V2 needs Triton. A GPU build
    serves it from the printed line."""
    from vllm.model_executor.models.qwen3_dflash import dflash_has_any_non_causal

    from speculators_train.engines.vllm.offline import Engine
    from speculators_train.errors import UserError

    hf_dir, _, _ = reference
    recipe, checkpoint, _, _ = fitted(family)
    out = tmp_path / "export"
    argv = ["export", str(recipe.source_path), "--checkpoint", str(checkpoint), "--out", str(out), "--dtype", "float32"]
    spec = printed_speculative_config(capsys, argv)
    parsed = vllm_config(out)
    draft = load_draft(out, target.num_layers).draft.config
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    vllm_spec = SpeculatorsConfig.extract_vllm_speculative_config(json.loads((out / "config.json").read_text()))
    assert spec["method"] == vllm_spec["method"] == {"dflash2": "dflash"}.get(family, family)
    assert parsed.draft_vocab_size == draft.draft_vocab_size
    assert parsed.eagle_aux_hidden_state_layer_ids == target.aux_layer_ids
    assert dflash_has_any_non_causal(parsed)
    refusal = f"Model Runner V1 does not support: {read_as_trained(family, parsed, draft)}"
    with pytest.raises(UserError, match=refusal), Engine(hf_dir, spec, in_process=True):
        pass


def test_vllm_serves_an_eagle3_draft_over_the_targets_whole_vocabulary(target, reference, tmp_path, capsys):
    """What only this proves: vLLM loads an EAGLE-3 export whose vocabulary is the target's whole one (its model
    then holds no d2t, and a file shipping one fails to load) and decodes the target's own greedy output. Random
    weights from the target's head: the output is the point, not the acceptance."""
    from speculators_train.engines.vllm.offline import Engine
    from speculators_train.head import load_head_weights
    from speculators_train.training.checkpoint import save_checkpoint
    from tests.conftest import start_of

    hf_dir, prompt, alone = reference
    family = get("eagle3")
    settings = family.settings(family="eagle3", ttt_steps=1, draft_vocab_size=target.vocab_size)
    config, weights = load_head_weights(tiny_config())
    freq = torch.ones(target.vocab_size, dtype=torch.int64)
    torch.manual_seed(0)
    draft = family.new_draft(settings, start_of(config, weights, freq, target.aux_layer_ids))
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, draft, None, {"step": 1}, keep_last=1)
    recipe = make_recipe(tmp_path, [{"name": "s", "path": SHAREGPT, "max_records": 8}])
    out = tmp_path / "export"
    argv = ["export", str(recipe), "--checkpoint", str(checkpoint), "--out", str(out), "--dtype", "float32"]
    spec = printed_speculative_config(capsys, argv)
    with Engine(hf_dir, spec, in_process=True) as engine:
        decoded = engine.generate([prompt], MAX_NEW, 0.0, 1.0, [0])
    assert decoded.completions[0].tokens == alone
    assert decoded.counts.drafts > 0


def test_vllm_regeneration_answers_each_turn_as_vllm_answers_the_prompt_alone(target, reference, monkeypatch):
    """`data.regenerate.engine: vllm`: the reply to a turn is what vLLM answers that rendered prompt alone, and a
    later turn is answered after the regenerated earlier one."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process, as in the module
    from speculators_train.data.chat import Chat
    from speculators_train.data.config import RegenerateConfig
    from speculators_train.data.conversations import Conversation
    from speculators_train.data.regenerate import regenerate_vllm
    from tests.conftest import PROMPT

    hf_dir, _, alone = reference
    conv = Conversation(
        "t:0",
        (
            PROMPT[0],
            {"role": "assistant", "content": "ORIGINAL ONE"},
            {"role": "user", "content": "Say it again, shorter."},
            {"role": "assistant", "content": "ORIGINAL TWO"},
        ),
        "x",
    )
    cfg = RegenerateConfig(enabled=True, max_new_tokens=MAX_NEW, engine="vllm")
    (out,) = regenerate_vllm([conv], Chat(target.tokenizer), cfg, max_length=512, seed=0, model=hf_dir)
    assert [m["role"] for m in out.messages] == ["user", "assistant", "user", "assistant"]
    assert out.messages[1]["content"] == target.tokenizer.decode(alone, skip_special_tokens=True).strip()
    assert out.messages[3]["content"] not in ("", "ORIGINAL TWO")


# Each architecture class vLLM serves here, one engine start each (tests/integration/test_targets.py: the rest).
# The default run serves gpt-oss (MoE, sinks, a sliding window); Llama 4's chunked attention runs with
# SPECULATORS_TRAIN_FULL=1, and by default our own loop decodes it exactly (tests/integration/test_targets.py).
VLLM_CLASSES = {"gpt-oss": {}, "llama4": {"attention_chunk_size": 128}}


@pytest.mark.parametrize("name", sweep(VLLM_CLASSES, ("gpt-oss",)))
def test_vllm_serves_the_printed_eagle3_line_on_each_architecture_class(tmp_path, capsys, name):
    """What only this proves: vLLM's own model classes for these architectures read our EAGLE-3 export's aux
    layers from the target, accept its drafts and decode exactly the target's greedy output (transformers' own,
    which the draft was fitted to: one engine start each)."""
    from dataclasses import replace

    from speculators_train.engines.vllm.offline import Engine
    from speculators_train.families.drafts import load_draft
    from tests.conftest import fit
    from tests.integration.test_targets import load, matrix_recipe
    from tests.targets import BY_NAME, build, text_decoder_folder

    arch = BY_NAME[name]
    folder = build(replace(arch, config={**arch.config, **VLLM_CLASSES[name]}), tmp_path / "target")
    if name == "llama4":
        folder = text_decoder_folder(folder, tmp_path / "text")
    target = load(lambda _: folder, name)
    _, checkpoint, prompt, reply = fit(target, tmp_path / "fit", "eagle3")
    recipe = matrix_recipe(tmp_path, folder, "eagle3")
    out = tmp_path / "export"
    spec = printed_speculative_config(
        capsys, ["export", str(recipe), "--checkpoint", str(checkpoint), "--out", str(out), "--dtype", "float32"]
    )
    assert load_draft(out, target.num_layers).family.name == "eagle3"
    with Engine(str(folder), spec, in_process=True) as engine:
        decoded = engine.generate([prompt], len(reply), 0.0, 1.0, [0])
    assert decoded.completions[0].tokens == reply
    assert decoded.counts.drafts > 0 and decoded.counts.accepted > 0, decoded.counts


def test_vllm_serves_our_mtp_head_on_a_glm_target_with_its_output_and_our_acceptance(tmp_path, capsys):
    """What only this proves: an MTP head started from a GLM-4.5-style target's own MTP layer and fitted to its
    reply is exported in the layout vLLM's `method: mtp` reads for that target (`Glm4MoeMTPModel`), and vLLM drafts
    with it exactly as our loop does: the target's greedy output, the same drafts accepted (AL within 2%)."""
    from speculators_train.engines.vllm.offline import Engine
    from speculators_train.proposal import Sampling
    from speculators_train.verify.decoder import SpeculativeDecoder
    from speculators_train.verify.run import eos_ids, load_draft_for
    from tests.conftest import fit
    from tests.integration.test_targets import load, matrix_recipe
    from tests.targets import BY_NAME, build

    folder = build(BY_NAME["glm4-moe"], tmp_path / "target")
    target = load(lambda _: folder, "glm4-moe")
    _, checkpoint, prompt, reply = fit(target, tmp_path / "fit", "mtp")
    recipe = matrix_recipe(tmp_path, folder, "mtp")
    out = tmp_path / "export"
    spec = printed_speculative_config(
        capsys, ["export", str(recipe), "--checkpoint", str(checkpoint), "--out", str(out), "--dtype", "float32"]
    )
    assert spec == {"model": str(out), "method": "mtp", "num_speculative_tokens": 3}
    loaded = load_draft_for(target, out)
    assert loaded.family.name == "mtp" and loaded.draft.config.from_target
    # vLLM drafts only after its prefill has sampled the reply's first token; our loop's first step drafts that
    # token too. Started on the prompt and that token, our loop takes vLLM's steps.
    ours = SpeculativeDecoder(target, loaded.family.proposer(loaded.draft, target), Sampling(), 3, None)
    ours = ours.generate(prompt + reply[:1], len(reply) - 1, eos_ids(target), None)
    assert ours.tokens == reply[1:]
    with Engine(str(folder), spec, in_process=True) as engine:
        decoded = engine.generate([prompt], len(reply), 0.0, 1.0, [0])
    assert decoded.completions[0].tokens == reply
    steps = ours.accepted
    per_position = [sum(a > i for a in steps) for i in range(3)]
    assert (decoded.counts.drafts, decoded.counts.per_position) == (len(steps), per_position), decoded.counts
    our_al = 1 + sum(steps) / len(steps)
    assert our_al > 2, steps  # a fitted head: a wrong position or state in vLLM would show here
    assert decoded.counts.acceptance_length == pytest.approx(our_al, rel=0.02), (decoded.counts, steps)


def test_vllm_serves_our_qwen3_next_style_mtp_head_from_its_mtp_layout_and_accepts_its_drafts(tmp_path, capsys):
    """What only this proves: a `qwen3_next`-style head, started from a Qwen3-Next target's own `mtp.*` layer and
    fitted to vLLM's greedy reply, is exported in the layout vLLM's `Qwen3NextMTP` loads (every tensor of it) and
    is run there as trained: vLLM accepts its drafts (a wrong tensor, norm or fed-back state would not: a head
    fitted to another reply got AL 1.07 and 1.18 here). vLLM's CPU gated-delta kernels run bfloat16 and head dim
    128 only, so the target is the matrix's with those heads, in bfloat16. There a verify pass of K + 1 tokens
    rounds apart from a one-token pass, and the output leaves the target-only one after a dozen tokens (vLLM's
    numerics; the GLM test proves the output in float32): acceptance is measured on the tokens before that. Our
    loop's output on this target is not vLLM's bf16 one (its own kernels round otherwise), so acceptance is vLLM's
    alone here; the loop's exactness on a recurrent target is test_targets' chain decode."""
    from dataclasses import replace

    from speculators_train.engines.vllm.offline import Engine
    from speculators_train.verify.run import load_draft_for
    from tests.conftest import fit, prompt_ids
    from tests.integration.test_targets import load, matrix_recipe
    from tests.targets import BY_NAME, build

    arch = BY_NAME["qwen3-next"]
    heads = {"linear_key_head_dim": 128, "linear_value_head_dim": 128, "num_nextn_predict_layers": 1}
    folder = build(replace(arch, config={**arch.config, **heads}), tmp_path / "target")
    target = load(lambda _: folder, "qwen3-next")
    prompt = prompt_ids(target)
    options = {"dtype": "bfloat16", "in_process": True, "enable_prefix_caching": False}  # its 'align' mode: Triton
    with Engine(str(folder), None, **options) as engine:
        alone = engine.generate([prompt], 48, 0.0, 1.0, [0]).completions[0].tokens
    _, checkpoint, _, _ = fit(target, tmp_path / "fit", "mtp", reply=alone, style="qwen3_next")
    recipe = matrix_recipe(tmp_path, folder, "mtp", draft={"style": "qwen3_next"})
    out = tmp_path / "export"
    spec = printed_speculative_config(
        capsys, ["export", str(recipe), "--checkpoint", str(checkpoint), "--out", str(out), "--dtype", "float32"]
    )
    assert spec == {"model": str(out), "method": "mtp", "num_speculative_tokens": 3}
    loaded = load_draft_for(target, out)
    assert loaded.draft.config.style == "qwen3_next" and loaded.draft.config.from_target
    with Engine(str(folder), spec, **options) as engine:
        drafted = engine.generate([prompt], len(alone), 0.0, 1.0, [0]).completions[0].tokens
        # Acceptance where vLLM's output is still its target-only output (the head was fitted to that): decoded
        # again up to there, the same steps run
        same = next((i for i, (a, b) in enumerate(zip(drafted, alone, strict=True)) if a != b), len(alone))
        if same < 8:  # where they part is bf16 rounding, which differs between instruction sets
            pytest.skip(f"vLLM's bf16 speculative output left its target-only output after {same} tokens here")
        decoded = engine.generate([prompt], same, 0.0, 1.0, [0])
    assert decoded.completions[0].tokens == alone[:same]
    assert decoded.counts.acceptance_length > 1.6, decoded.counts  # 2.4 on the CI kind, 1.07-1.18 for a wrong head
