"""llama.cpp as a real engine: the GGUF export carries what llama.cpp's loader reads, and llama-server (built here
from the llama-cpp-python source archive) decodes with our draft and gives exactly its own target-only output on
an unquantized target."""

from pathlib import Path

import pytest
import torch

from speculators_train.engines.llamacpp.server import Completion, Server, draft_args, parse_metrics
from speculators_train.engines.llamacpp.verify import f32_gguf, record, settings
from speculators_train.errors import UserError
from speculators_train.export.run import export
from speculators_train.families import get
from speculators_train.families.drafts import load_draft
from speculators_train.families.vocab import draft_to_target
from speculators_train.origin import resolve_origin
from speculators_train.recipe import load_recipe
from speculators_train.training.checkpoint import save_checkpoint
from speculators_train.verify.report import first_divergence
from tests.conftest import SHAREGPT, make_recipe, start_of, sweep


def decoded(recipe, args: list[str], prompt: list[int], tmp_path: Path) -> tuple[Completion, Completion]:
    """(target-only, with `args`) greedy completions of `prompt` by llama-server on the recipe's target as F32."""
    target_gguf = f32_gguf(Path(resolve_origin(recipe.target)[0]))
    with (
        Server(target_gguf, [], tmp_path / "base.log") as base,
        Server(target_gguf, args, tmp_path / "spec.log") as spec,
    ):
        return base.complete(prompt, 48), spec.complete(prompt, 48)


def test_metrics_text_parses_counters_and_per_position_acceptance():
    text = "\n".join(
        [
            "# HELP llamacpp:spec_decode_num_drafts_total Speculative: Total speculative decoding verification steps",
            "llamacpp:spec_decode_num_drafts_total 12",
            'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 9',
            'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 3',
            "llamacpp:predicted_tokens_seconds 81.5",
        ]
    )
    m = parse_metrics(text)
    assert m["spec_decode_num_drafts_total"] == 12
    assert m["spec_decode_num_accepted_tokens_per_pos_total"] == [9, 0, 3]
    assert m["predicted_tokens_seconds"] == 81.5


def test_a_record_counts_acceptance_and_identity_as_llamacpp_reports_them(tmp_path):
    # Prompt 1: 4 steps at K = 2 accepting 2, 1, 0, 2 drafts -> 1 + 4 + 5 = 10 tokens; prompt 2 forks at token 3.
    spec = [
        Completion(list(range(10)), 1.0, 0.1, drafted=8, accepted=5, steps=4, accepted_per_position=[3, 2]),
        Completion([5, 6, 7, 9], 1.0, 0.1, drafted=2, accepted=0, steps=1, accepted_per_position=[0, 0]),
    ]
    base = [Completion(list(range(10)), 2.0, 0.1), Completion([5, 6, 7, 8], 2.0, 0.1)]
    r = record("s", "f32", tmp_path / "t.gguf", "draft", 2, spec, base)
    assert r["acceptance_length"] == pytest.approx(1 + 5 / 5)  # pooled over the 5 steps
    assert r["acceptance_length_per_request_mean"] == pytest.approx((1 + 5 / 4 + 1 + 0 / 1) / 2)  # SpecForge's
    assert r["per_position_acceptance"] == [pytest.approx(3 / 5), pytest.approx(2 / 5)]
    assert r["draft_acceptance_rate"] == pytest.approx(5 / 10)
    assert r["tokens_per_target_pass"] == pytest.approx((9 + 3) / (4 + 3))
    assert r["greedy_identical_outputs"] == "1/2" and r["first_divergence"] == [None, 3]
    assert r["speedup"] == pytest.approx((14 / 2.2) / (14 / 4.2))
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_each_setting_passes_the_flags_llamacpp_needs(tmp_path):
    recipe = load_recipe(
        make_recipe(
            tmp_path,
            [{"name": "sharegpt", "path": SHAREGPT, "max_records": 8}],
            eval={
                "engine": "llama.cpp",
                "draft_p_min": 0.2,
                "llama_cpp": {"speculative_tokens": [3], "baselines": ["ngram-mod"]},
            },
        )
    )
    (draft, k, args), (ngram, none, ngram_args) = settings(recipe, get("eagle3").formats["gguf"], tmp_path)
    assert (draft, k, ngram, none) == ("draft", 3, "ngram-mod", None)
    flags = dict(zip(args[::2], args[1::2], strict=True))
    assert flags["-md"] == str(tmp_path / "draft.gguf")
    assert flags["--spec-type"] == "draft-eagle3"  # not detected from the file
    plain = draft_args(tmp_path / "d.gguf", get("draft_model").formats["gguf"].llamacpp_spec_type, 3)
    assert plain[plain.index("--spec-type") + 1] == "draft-simple"  # a plain LM: without a type it never drafts
    assert "--spec-type" not in draft_args(tmp_path / "d.gguf", None, 3)  # a type the server reads off the file
    assert (flags["--spec-draft-n-max"], flags["--spec-draft-p-min"]) == ("3", "0.2")
    assert ngram_args == ["--spec-type", "ngram-mod"]


def test_gguf_export_carries_the_layer_ids_vocab_map_and_flags_llamacpp_reads(tmp_path, target, fitted, capsys):
    from gguf import GGUFReader

    from speculators_train.cli import main

    recipe, checkpoint, _, _ = fitted()
    out = tmp_path / "gguf"
    argv = ["export", str(recipe.source_path), "--checkpoint", str(checkpoint), "--format", "gguf", "--out", str(out)]
    with pytest.raises(SystemExit) as code:
        main(argv)
    assert code.value.code == 0
    reader = GGUFReader(out / "draft.gguf")

    def field(name):
        f = reader.fields[name]
        values = [f.parts[i].tolist() for i in f.data]
        return values if len(values) > 1 else values[0]

    assert bytes(field("general.architecture")).decode() == "eagle3"
    assert [v[0] for v in field("eagle3.target_layers")] == target.aux_layer_ids == [2, 4, 5]
    assert field("eagle3.target_hidden_size")[0] == target.hidden_size
    assert field("eagle3.norm_before_residual")[0] is False
    tensors = {t.name: t for t in reader.tensors}
    loaded = load_draft(checkpoint, target.num_layers).draft
    d2t = torch.from_numpy(tensors["d2t"].data.copy()).to(torch.int64)
    assert torch.equal(d2t, draft_to_target(loaded.d2t))  # absolute target ids, not our offsets
    assert tuple(tensors["fc.weight"].shape)[::-1] == tuple(loaded.fc.weight.shape)
    printed = capsys.readouterr()
    assert f"-md {out / 'draft.gguf'} --spec-type draft-eagle3 --spec-draft-n-max 5" in printed.out
    # an HF target: the line names the GGUF llama-server needs, and the note says how to make it
    served = f"{Path(recipe.target.name_or_path).name}.gguf"
    assert f"llama-server -m {served} " in printed.out
    assert f"the target is not a GGUF file: make {served} once" in " ".join(printed.err.split())
    # a GGUF target: the line serves the very file the recipe names, and the card says what trained against it
    gguf_target = f32_gguf(Path(recipe.target.name_or_path))
    again = recipe.source_path.parent / "gguf-target.yaml"
    again.write_text(recipe.source_path.read_text().replace(recipe.target.name_or_path, str(gguf_target)))
    argv = ["export", str(again), "--checkpoint", str(checkpoint), "--format", "gguf", "--out", str(tmp_path / "g2")]
    with pytest.raises(SystemExit) as code:
        main(argv)
    assert code.value.code == 0
    assert f"llama-server -m {gguf_target} " in capsys.readouterr().out
    card = (tmp_path / "g2" / "README.md").read_text()
    assert f"the GGUF file `{gguf_target.name}`, dequantised to float by transformers" in card


def test_llamacpp_refuses_nothing_we_export_and_we_refuse_what_it_would_run_wrong(tmp_path, target):
    family = get("eagle3")
    head = {"embed": target.embed_tokens.weight, "lm_head": target.lm_head.weight, "norm": target.final_norm.weight}
    freq = torch.ones(target.vocab_size)
    draft = family.new_draft(family.settings(draft_vocab_size=64), start_of(target.config, head, freq, [2, 5]))
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, draft, None, {"step": 1}, keep_last=1)
    recipe = load_recipe(make_recipe(tmp_path, [{"name": "sharegpt", "path": SHAREGPT, "max_records": 8}]))
    with pytest.raises(UserError, match="exactly 3 target states"):
        export(recipe, checkpoint, "gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # llama.cpp feeds the pre-norm output back whatever norm_output says: refused, for SGLang too.
    settings_ = family.settings(draft_vocab_size=64, norm_before_fc=True, norm_output=True)
    draft = family.new_draft(settings_, start_of(target.config, head, freq, target.aux_layer_ids))
    checkpoint = save_checkpoint(tmp_path / "ckpt31", 1, draft, None, {"step": 1}, keep_last=1)
    with pytest.raises(UserError, match=r"norm_output is true, but llama\.cpp ignores it"):
        export(recipe, checkpoint, "gguf", tmp_path / "out")
    with pytest.raises(UserError, match="norm_before_fc is true, but SGLang"):
        export(recipe, checkpoint, "sglang", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert export(recipe, checkpoint, "speculators", tmp_path / "out").path.is_dir()


@pytest.mark.timeout(3600)  # the first run on a machine builds llama.cpp (10-20 minutes on 2 cores)
# The default run serves EAGLE-3 and DSpark (the block path with its Markov and confidence heads); DFlash and DFlash2
# (the same block path in the converter's other two readings) run with SPECULATORS_TRAIN_FULL=1, and by default
# their GGUF is read back and checked against llama.cpp's reading by tests/integration/test_families.py.
@pytest.mark.parametrize("family", sweep(["eagle3", "dflash", "dspark", "dflash2"], ("eagle3", "dspark")))
def test_llamacpp_with_our_draft_gives_its_own_target_only_output_on_an_unquantized_target(
    tmp_path, target, fitted, family
):
    """Built once from source (cached); on the F32 target llama.cpp's greedy output must not change with the
    draft, and the draft fitted to this reply must be accepted. DFlash: llama.cpp's converter reads our
    speculators files as its DSpark without a Markov head (`families/block/gguf.py`); DSpark: as written, its
    Markov and confidence heads included, served with the confidence head stopping chains (p_min); DFlash2: in
    z-lab's flat layout through its DFlash class, its convolutions and selector included."""
    recipe, checkpoint, prompt, _ = fitted(family)
    fmt = get(family).formats["gguf"]
    out = export(recipe, checkpoint, "gguf", tmp_path / "gguf", dtype="float32").path
    if family != "eagle3":  # the converter's reading of our aux ids, block and mask token (SPEC.md section 10)
        from gguf import GGUFReader

        reader, cfg = GGUFReader(out / fmt.draft_file), load_draft(out, target.num_layers).draft.config
        fields = reader.fields
        assert fields["general.architecture"].contents() == fmt.draft_architecture
        assert fields["dflash.target_layers"].contents() == list(cfg.aux_layer_ids) == target.aux_layer_ids
        assert fields["dflash.block_size"].contents() == cfg.block_size
        assert fields["tokenizer.ggml.mask_token_id"].contents() == cfg.mask_token_id
        anchor = fields.get("dflash.sample_from_anchor")  # absent: llama.cpp's default, false
        assert (anchor is not None and anchor.contents()) == (family == "dspark")
        heads = {"markov_w1.weight", "markov_w2.weight", "conf_proj.weight"}
        names = {t.name for t in reader.tensors}
        assert (heads <= names) == (family == "dspark")
        selector = {"selector_predecessor.weight", "selector_successor.weight", "blk.0.attn_conv_proj.weight"}
        assert (selector <= names) == (family == "dflash2"), names
        if family == "dflash2":
            options = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
            assert [fields[f"dflash.{key}"].contents() for key in options] == [getattr(cfg, key) for key in options]
    args = draft_args(out / fmt.draft_file, fmt.llamacpp_spec_type, 3, 0.05 if family == "dspark" else 0.0)
    reference, drafted = decoded(recipe, args, prompt, tmp_path)
    assert drafted.tokens == reference.tokens
    assert drafted.steps > 0 and drafted.accepted > 0, drafted


def near_tie_slack(completion) -> int:
    """How far llama.cpp's accepted count may be from our loop's with the same draft and F32 weights: a draft
    argmax at a near-tie can fall either way between two engines' kernels, and how often depends on the machine
    (3 of 50 drafts on an AVX-512 Xeon, at most 2 on AVX2 EPYCs). A draft llama.cpp ran wrongly (a missing norm,
    a shifted state) loses a third or more of its accepted drafts."""
    return max(2, completion.drafted // 10)


@pytest.mark.timeout(3600)
def test_llamacpp_runs_a_norm_before_fc_draft_as_trained(tmp_path, target, fitted):
    """EAGLE-3.1's norm before fc reaches llama.cpp (flag and weight) and is applied: llama.cpp accepts what the
    project's own loop accepts with the same draft on the same unquantized weights (without the norm this draft's
    first-step argmax changes at about a third of the reply's positions), and the output is the target's own."""
    from gguf import GGUFReader

    from speculators_train.proposal import Sampling
    from speculators_train.verify.decoder import SpeculativeDecoder
    from speculators_train.verify.run import eos_ids, load_draft_for

    recipe, checkpoint, prompt, _ = fitted(norm_before_fc=True)
    out = export(recipe, checkpoint, "gguf", tmp_path / "gguf", dtype="float32").path
    reader = GGUFReader(out / "draft.gguf")
    flag = reader.fields["eagle3.norm_before_fc"]
    assert flag.parts[flag.data[0]].tolist()[0] is True
    norm = load_draft(checkpoint, target.num_layers).draft.input_norm.weight
    stored = [t for t in reader.tensors if tuple(t.data.shape) == tuple(norm.shape) and "norm" in t.name]
    assert len(stored) == 1 and torch.allclose(torch.from_numpy(stored[0].data.copy()), norm.detach())
    reference, drafted = decoded(recipe, draft_args(out / "draft.gguf", "draft-eagle3", 3), prompt, tmp_path)
    assert drafted.tokens == reference.tokens
    assert drafted.accepted >= 0.5 * drafted.drafted > 0, drafted
    draft = load_draft_for(target, checkpoint).draft
    ours = SpeculativeDecoder(target, get("eagle3").proposer(draft, target), Sampling(), 3, None)
    ours = ours.generate(prompt, 48, eos_ids(target), None)
    assert ours.tokens == drafted.tokens
    assert abs(sum(ours.accepted) - drafted.accepted) <= near_tie_slack(drafted), (ours.accepted, drafted)


@pytest.mark.timeout(3600)
def test_llamacpp_serves_a_draft_model_with_its_own_output_and_our_acceptance(tmp_path, target, fitted):
    """A standalone draft converted by llama.cpp's own converter and run with `-md` (no `--spec-type`): the target's
    own greedy output, and the drafts our loop accepts with the same draft, K and unquantized weights."""
    from gguf import GGUFReader

    from speculators_train.proposal import Sampling
    from speculators_train.verify.decoder import SpeculativeDecoder
    from speculators_train.verify.run import eos_ids, load_draft_for

    recipe, checkpoint, prompt, _ = fitted("draft_model")
    fmt = get("draft_model").formats["gguf"]
    out = export(recipe, checkpoint, "gguf", tmp_path / "gguf", dtype="float32").path
    reader = GGUFReader(out / fmt.draft_file)
    arch = reader.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == fmt.draft_architecture
    assert sum(t.name.startswith("blk.") and t.name.endswith("attn_q.weight") for t in reader.tensors) == 2
    args = draft_args(out / fmt.draft_file, fmt.llamacpp_spec_type, 3)
    assert args[args.index("--spec-type") + 1] == "draft-simple"  # else llama-server loads it and never drafts
    reference, drafted = decoded(recipe, args, prompt, tmp_path)
    assert drafted.tokens == reference.tokens
    draft = load_draft_for(target, checkpoint).draft
    ours = SpeculativeDecoder(target, get("draft_model").proposer(draft, target), Sampling(), 3, None)
    ours = ours.generate(prompt, 48, eos_ids(target), None)
    assert ours.tokens == drafted.tokens
    assert drafted.accepted > 0, drafted
    assert abs(sum(ours.accepted) - drafted.accepted) <= near_tie_slack(drafted), (ours.accepted, drafted)
