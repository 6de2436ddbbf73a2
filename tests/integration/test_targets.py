"""Every target a user serves: tiny random-weight targets of each architecture class (tests/targets.py), built from
transformers' own configs, through every stage, or refused with the reason before any work.

A target here is 8 layers, 128 wide: a stage on it takes seconds, so the CLI runs each one in this process. What the
matrix proves per target: the stored states are the model's own, the training head gives its logits, the verify loop
decodes exactly as transformers does (drafts accepted and rejected, chain and tree, across sliding windows), and
every stage runs for every family. The default run does the first on every target and the rest on one target per
class (`CI_STAGES`, `DECODE_CLASSES`, `DECODED_FAMILIES`); SPECULATORS_TRAIN_FULL=1 runs the whole cross product.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from speculators_train.cli import main
from tests.conftest import FULL, SHAREGPT, make_recipe, sweep
from tests.targets import BY_NAME, MATRIX, build

FAMILIES = ("eagle3", "peagle", "dflash", "medusa", "mlp", "draft_model", "mtp")
# CI's share of the stage matrix: a target per class (MoE + sliding window + sinks, a multimodal wrapper, MLA, hybrid
# linear attention, hybrid Mamba) with EAGLE-3 (DFlash on Nemotron-H), the draft model on the ones whose layers differ
# in kind, MTP on the MoE target that ships MTP layers, and on gpt-oss a family that reads target states (EAGLE-3) and
# a block drafter (DFlash). Every family runs each stage on the session's tiny Llama (tests/integration/
# test_families.py, test_loss_curves.py).
CI_STAGES = {
    "gpt-oss": ("eagle3", "dflash"),
    "gemma3": ("eagle3",),
    "deepseek-v3": ("eagle3",),
    "qwen3-next": ("eagle3",),
    "nemotron-h": ("dflash",),
    "llama4": ("draft_model",),
    "qwen2.5-vl": ("draft_model",),
    "glm4-moe": ("mtp",),
}
SETTINGS = {
    "eagle3": {"ttt_steps": 3, "draft_vocab_size": 512},
    "peagle": {"depths": 3, "mask_token_id": 16, "draft_vocab_size": 512},
    "dflash": {"block_size": 4, "num_layers": 1, "mask_token_id": 16, "draft_vocab_size": 512},
    "medusa": {"num_heads": 3, "draft_vocab_size": 512},
    "mlp": {"n_predict": 3, "inner_dim": 64},
    "draft_model": {"layers": [0, 3]},
    "mtp": {"num_steps": 2},
}
AUX = [2, 4, 6]  # below the default [2, N//2, N-3] = [2, 4, 5] of 8 layers, which repeats no id but sits close


def combos() -> list[tuple[str, str]]:
    return [
        (arch.name, family) for arch in MATRIX for family in FAMILIES if FULL or family in CI_STAGES.get(arch.name, ())
    ]


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """Each target built once for the session (a second or two each)."""
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            done[name] = build(BY_NAME[name], tmp_path_factory.mktemp(f"target-{name}"))
        return done[name]

    return get


def cli(argv: list, capsys=None) -> tuple[int, str]:
    """The CLI in this process: (exit code, its standard error on one line, with `capsys`)."""
    if capsys is not None:
        capsys.readouterr()
    try:
        main([str(a) for a in argv])
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, " ".join(capsys.readouterr().err.split()) if capsys is not None else ""


def matrix_recipe(tmp: Path, target: Path, family: str, draft: dict | None = None, **sections) -> Path:
    sources = [{"name": "sharegpt", "path": SHAREGPT, "max_records": 24}]
    return make_recipe(
        tmp,
        sources,
        target={"name_or_path": str(target), "aux_layer_ids": AUX},
        draft={"family": family, **SETTINGS[family], **(draft or {})},
        training={"epochs": 1, "batch_size": 4, "max_steps": 3, "wandb": {"mode": "disabled"}},
        export={"dtype": "float32"},
        eval={
            "suites": ["eval/suites/sharegpt-held-out.yaml"],
            "num_prompts": 1,
            "max_new_tokens": 12,
            "num_speculative_tokens": 3,
        },
        **sections,
    )


@pytest.fixture(scope="session")
def generated(built, tmp_path_factory):
    """`generate` once per target (every family reads a subset of the aux + final states it stores)."""
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            recipe = matrix_recipe(tmp_path_factory.mktemp(f"states-{name}"), built(name), "eagle3")
            code, _ = cli(["generate", recipe])
            assert code == 0, f"generate failed on {name}"
            done[name] = recipe.parent / "run" / "hidden_states"
        return done[name]

    return get


@pytest.mark.parametrize("name", [arch.name for arch in MATRIX])
def test_states_head_and_decoding_are_the_targets_own(built, name):
    """The stored aux states are transformers' `hidden_states` at their ids, the training head built from the
    checkpoint's tensors (the text decoder's, inside a multimodal wrapper) gives the model's logits from the stored
    final state, and the verify loop's target-only decode is transformers' greedy decode."""
    from speculators_train.data.chat import Chat
    from speculators_train.head import TargetHead, load_head_weights
    from speculators_train.proposal import Sampling
    from speculators_train.recipe import TargetConfig
    from speculators_train.target import load_target
    from speculators_train.verify.decoder import decode_plain

    cfg = TargetConfig(name_or_path=str(built(name)), aux_layer_ids=AUX)
    target = load_target(cfg)
    prompt = Chat(target.tokenizer).prompt_ids([{"role": "user", "content": "Write a long story about a dragon."}])
    ids = torch.tensor([prompt])
    aux, final = target.hidden_states(ids, None)
    with torch.no_grad():
        out = target.model(input_ids=ids, output_hidden_states=True)
    expected = torch.cat([out.hidden_states[i] for i in AUX], dim=-1)
    torch.testing.assert_close(aux, expected, rtol=1e-5, atol=1e-5)
    config, weights = load_head_weights(cfg)
    torch.testing.assert_close(TargetHead.from_weights(config, weights)(final), out.logits, rtol=1e-5, atol=1e-4)
    new = 40  # past the sliding windows (16 wide) of the targets that have them
    with torch.no_grad():
        reference = target.model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    assert decode_plain(target, prompt, new, set(), Sampling()).tokens == reference[0, len(prompt) :].tolist()


@pytest.mark.parametrize(("name", "family"), combos(), ids=[f"{n}-{f}" for n, f in combos()])
def test_every_stage_runs_for_every_family(built, generated, tmp_path, capsys, name, family):
    """data, train, export and verify in the CLI (generate: once per target, above), or a refusal naming the
    reason before any work; verify's greedy output is the target's own; doctor then finds nothing wrong."""
    recipe = matrix_recipe(tmp_path, built(name), family, DRAFT.get((name, family)))
    refusal = REFUSED.get((name, family))
    code, err = cli(["data", recipe], capsys)
    if refusal is not None:
        assert code == 2 and refusal in err, err
        return
    assert code == 0, err
    shutil.copytree(generated(name), tmp_path / "run" / "hidden_states")
    for stage in (["train", recipe], ["export", recipe, "--force"], ["verify", recipe, "--out", tmp_path / "verify"]):
        code, err = cli(stage, capsys)
        assert code == 0, f"{name} {family}: {stage[0]}: {err}"
    # the draft's record, then the n-gram baseline decoded beside it (eval.baselines); both exact
    record, free = json.loads((tmp_path / "verify" / "results.json").read_text())
    assert free["shape"].startswith("ngram") and free["greedy_identical_outputs"] == "1/1", free
    assert record["greedy_identical_outputs"] == "1/1", record
    # doctor on this export and these runs: every check runs, and a clean pipeline fails none
    from speculators_train.doctor.run import doctor
    from speculators_train.recipe import load_recipe

    _, checks = doctor(load_recipe(recipe), None, None, "vllm", tmp_path / "doctor")
    assert [c for c in checks if c.status == "fail"] == [], f"{name} {family}"
    assert {"K", "verifier: training states and export against the target now"} <= {c.name for c in checks}


# Families refused for a target at recipe load, with the reason the refusal names.
REFUSED = {
    ("qwen2.5-vl", "draft_model"): "(Qwen2_5_VLTextConfig) has no causal-LM class",
    ("qwen2.5-vl", "mtp"): "(Qwen2_5_VLTextConfig) has no causal-LM class",
    ("nemotron-h", "mtp"): "NemotronHBlock at that slot and its decoder have no self_attn or rotary_emb",
}
RECURRENT = {"qwen3-next", "nemotron-h"}  # hybrid linear attention and Mamba: the loop verifies chains only
# A draft model of a hybrid target's layers takes the ones without a recurrent state (full attention, and an MLP
# block on Nemotron-H).
DRAFT = {("qwen3-next", "draft_model"): {"layers": [3, 7]}, ("nemotron-h", "draft_model"): {"layers": [1, 2]}}


@pytest.mark.parametrize(
    ("name", "draft", "refusal"),
    [
        ("qwen3-next", {"layers": [0, 3]}, "target layer 0 is linear_attention, whose recurrent state a draft cannot"),
        ("nemotron-h", {"start": "fresh"}, "draft.layers among [1, 2, 3, 5, 6, 7]"),
        ("nemotron-h", {"family": "mtp"}, REFUSED[("nemotron-h", "mtp")]),
    ],
)
def test_a_draft_that_would_keep_a_recurrent_state_or_lacks_attention_is_refused_at_load(
    built, tmp_path, capsys, name, draft, refusal
):
    """A draft LM drops rejected tokens from its cache, which a recurrent layer's state cannot do: a draft model of
    a hybrid target's recurrent layers is refused before any work, naming the layers it can take (those run every
    stage: test_every_stage_runs_for_every_family). An MTP head is an attention layer of the target's class: a
    hybrid Mamba block has none."""
    draft = dict(draft)
    family = draft.pop("family", "draft_model")
    code, err = cli(["data", matrix_recipe(tmp_path, built(name), family, draft)], capsys)
    assert code == 2 and refusal in err, err


def load(built, name: str):
    from speculators_train.recipe import TargetConfig
    from speculators_train.target import load_target

    return load_target(TargetConfig(name_or_path=str(built(name)), aux_layer_ids=AUX))


def fitted_draft(target, tmp: Path, family: str):
    """(family, draft placed on the target, prompt): a draft of `family` fitted to the target's first 48 reply
    tokens (conftest.fit)."""
    from speculators_train.families.drafts import load_draft
    from tests.conftest import fit

    _, checkpoint, prompt, _ = fit(target, tmp, family)
    loaded = load_draft(checkpoint, target.num_layers)
    loaded.family.attach_target(loaded.draft, target.embed_tokens.weight, loaded.has_embedding)
    return loaded.family, loaded.family.place(loaded.draft, target.device, target.dtype), prompt


def decodes_exactly(target, fitted, trees: bool) -> None:
    """A fitted draft (`fitted_draft`) decodes 64 tokens with the chain (and a tree): its drafts are accepted, then
    rejected past what it was fitted to, and the output must be the target-only greedy decode."""
    from speculators_train.proposal import Sampling, TreeSpec
    from speculators_train.verify.decoder import SpeculativeDecoder, decode_plain

    fam, draft, prompt = fitted
    reference = decode_plain(target, prompt, 64, set(), Sampling()).tokens
    for tree in (None, TreeSpec(2, 3, 6)) if trees else (None,):
        decoder = SpeculativeDecoder(target, fam.proposer(draft, target), Sampling(), 3, tree)
        out = decoder.generate(prompt, 64, set())
        assert out.tokens == reference, (fam.name, tree)
        assert 0 < sum(out.accepted) < 3 * len(out.accepted), "drafts must be both accepted and rejected"


# In CI: sliding windows on 5 of 6 layers, chunked attention in a wrapper, MLA, recurrent layers (gpt-oss: in the
# every-family test below); every target with the whole matrix.
DECODE_CLASSES = ("gemma3-text", "llama4", "deepseek-v3", "qwen3-next", "nemotron-h")


def decoded_targets() -> list[str]:
    return [a.name for a in MATRIX if FULL or a.name in DECODE_CLASSES]


@pytest.mark.parametrize("name", decoded_targets())
def test_accepted_and_rejected_drafts_leave_the_targets_greedy_output(built, tmp_path, name):
    """An EAGLE-3 draft fitted to the target's reply: chain and tree verification roll the cache back past
    rejected drafts (sliding-window and chunked layers keep every key; the tree's mask applies their window;
    Qwen3-Next's linear-attention states are restored and the accepted tokens run again), and 64 tokens (past
    every 16-wide window here) are the target's own."""
    target = load(built, name)
    decodes_exactly(target, fitted_draft(target, tmp_path, "eagle3"), trees=name not in RECURRENT)


# A chain drafter that reads target states and a block drafter; every family's proposer decodes the tiny Llama's
# own greedy output by default (tests/integration/test_families.py), and the full run does each one here too.
DECODED_FAMILIES = sweep(FAMILIES, ("eagle3", "dflash"))


@pytest.mark.parametrize("family", DECODED_FAMILIES)
def test_every_family_decodes_exactly_on_a_moe_sliding_window_target(built, tmp_path, family):
    """gpt-oss: MoE, attention sinks, a sliding window on every other layer, the harmony template. Greedy: the
    target's output; T=1 over 200 seeds with sampled drafts: the first token and the one after the most common
    first token follow the target's distributions within 4x sampling noise (accepted drafts, residuals, bonus)."""
    from speculators_train.packed import packed_linears
    from speculators_train.proposal import Sampling
    from speculators_train.verify.decoder import SpeculativeDecoder, verify_width
    from speculators_train.verify.sampling import target_probs
    from tests.integration.test_verify import PrefilledOnce
    from tests.unit.test_sampling_rules import tv, tv_threshold

    target = load(built, "gpt-oss")
    fam, draft, prompt = fitted = fitted_draft(target, tmp_path, family)
    decodes_exactly(target, fitted, trees=family == "eagle3")
    out = []
    with packed_linears([target.model], verify_width(2, None)):
        runner = PrefilledOnce(target, prompt, fam.proposer(draft, target).states)
        for seed in range(200):
            decoder = SpeculativeDecoder(target, fam.proposer(draft, target), Sampling(1.0, draft_sampling="sample"), 2)
            decoder.runner = runner
            out.append(decoder.generate(prompt, 2, set(), torch.Generator().manual_seed(seed)))

    def follows(prefix: list[int], samples: list[int]) -> None:
        with torch.no_grad():
            p = target_probs(target.model(torch.tensor([prefix])).logits[0, -1], Sampling(1.0))
        assert tv(samples, p) < tv_threshold(p, len(samples))

    firsts = [r.tokens[0] for r in out]
    follows(prompt, firsts)
    common = max(set(firsts), key=firsts.count)
    seconds = [r.tokens[1] for r in out if r.tokens[0] == common]
    if len(seconds) >= 60:
        follows([*prompt, common], seconds)


def test_a_tree_sees_what_each_layer_type_sees(built):
    """The tree's mask per layer type: full attention sees every cached key; a sliding layer only the last
    `window` positions before a node (by the node's position, start + depth); a chunked layer its own chunk."""
    from speculators_train.proposal import DraftTree
    from speculators_train.verify.decoder import TargetRunner

    runner = TargetRunner(load(built, "gpt-oss"))
    tree = DraftTree(tokens=[5, 6, 7], parents=[-1, 0, -1], depths=[1, 2, 1])
    masks = runner._tree_mask(40, tree)
    assert set(masks) == {"full_attention", "sliding_attention"}
    seen = {kind: (mask[0, 0] == 0) for kind, mask in masks.items()}
    full, sliding = seen["full_attention"], seen["sliding_attention"]
    assert full[2, :41].all() and full[2, 41] and full[2, 42] and not full[2, 43]  # node 2 (depth 2): its path
    window = runner.target.text_config.sliding_window
    for node, position in enumerate([40, 41, 42, 41]):
        assert sliding[node, : position - window + 1].sum() == 0  # older than the window
        assert sliding[node, position - window + 1 : 40].all()  # the cache inside it
    runner.kinds, runner.windows = ["chunked_attention"], {"chunked_attention": ("chunk", 16)}
    chunked = runner._tree_mask(40, tree)[0, 0] == 0
    assert not chunked[0, :32].any() and chunked[0, 32:41].all()  # position 40 is in the chunk 32..47


def test_a_recurrent_target_is_verified_in_chains_and_refused_trees_before_any_work(built, tmp_path, capsys):
    """Qwen3-Next keeps one recurrent state per linear-attention layer, which a tree's branches cannot share:
    `verify` with eval.mode tree refuses it before loading anything and names the chain mode (the chain decodes
    exactly: test_accepted_and_rejected_drafts_leave_the_targets_greedy_output)."""
    recipe = matrix_recipe(tmp_path, built("qwen3-next"), "eagle3")
    code, err = cli(["verify", recipe, "--set", "eval.mode=tree"], capsys)
    assert code == 2 and "linear_attention layers keep one recurrent state" in err and "mode: chain" in err, err


# vLLM's CPU build per architecture class it runs: MoE with attention sinks and a sliding window (gpt-oss), and a
# multimodal model's text decoder with chunked attention and MoE (Llama-4's; vLLM's block size is 128, so its chunk
# is 128 here). The multimodal wrappers themselves need torchvision, which the CPU build does not install.
def _png(color: tuple[int, int, int], size: tuple[int, int] = (64, 48)) -> bytes:
    import io

    from PIL import Image

    image = Image.new("RGB", size, color)
    for x in range(0, size[0], 8):  # a pattern, so the vision tower's features vary across the image
        image.putpixel((x, x % size[1]), (255 - color[0], 255 - color[1], 255 - color[2]))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def image_records(folder: Path) -> Path:
    """A JSONL of OpenAI-style records with images: a data URL beside text, a file path relative to the data file in
    an image-only turn of a two-turn record, and a data URL that is not an image."""
    import base64

    (folder / "pics").mkdir(parents=True, exist_ok=True)
    (folder / "pics" / "blue.png").write_bytes(_png((20, 40, 220)))
    red = "data:image/png;base64," + base64.b64encode(_png((220, 30, 30))).decode()

    def image(url: str) -> dict:
        return {"type": "image_url", "image_url": {"url": url}}

    records = [
        {
            "id": "red",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "What colour is this?"}, image(red)]},
                {"role": "assistant", "content": "Red, with a few pale dots along a diagonal line."},
            ],
        },
        {
            "id": "blue",
            "messages": [
                {"role": "user", "content": [image("pics/blue.png")]},
                {"role": "assistant", "content": "A blue rectangle."},
                {"role": "user", "content": "Is it a square?"},
                {"role": "assistant", "content": "No: it is wider than it is tall."},
            ],
        },
        {
            "id": "broken",
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "And this?"}, image("data:image/png;base64,AAAA")],
                },
                {"role": "assistant", "content": "Nothing I can read."},
            ],
        },
    ]
    path = folder / "images.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


IMAGE_SKIPS = ("bad_image", "non_text_content", "no_image_processor")


def test_records_with_images_reach_the_target_through_its_processor(built, tmp_path, capsys):
    """Records with images (OpenAI `image_url` parts: a data URL, a file beside the data) on a multimodal target
    with its processor: `generate` stores the states the whole model computes with the images' pixel values (each
    placeholder expanded into the image's tokens, which the mask never covers); an unreadable image is a counted
    skip. On a text-only target their text is read and a turn of images alone is skipped; on a multimodal target
    whose processor cannot be loaded, every record with images is skipped with that reason."""
    from transformers import AutoProcessor
    from transformers.image_utils import load_image

    from speculators_train.hidden_states.shards import HiddenStateShards
    from speculators_train.recipe import TargetConfig
    from speculators_train.target import load_target

    data = image_records(tmp_path / "data")
    sources = [{"name": "pictures", "path": str(data)}, {"name": "sharegpt", "path": SHAREGPT, "max_records": 6}]

    def recipe(name: str) -> Path:
        target = {"name_or_path": str(built(name)), "aux_layer_ids": AUX}
        return make_recipe(tmp_path / name, sources, target=target, draft={"family": "eagle3", **SETTINGS["eagle3"]})

    skips = {
        "gemma3": {"bad_image": 1},
        "gemma3-text": {"non_text_content": 1},
        "qwen2.5-vl": {"no_image_processor": 3},
    }
    for name, expected in skips.items():
        capsys.readouterr()
        try:
            main(["data", str(recipe(name))])
        except SystemExit as exc:
            assert not exc.code, capsys.readouterr().err
        skipped = json.loads(capsys.readouterr().out.splitlines()[-1])["skipped"]
        assert {k: n for k, n in skipped.items() if k in IMAGE_SKIPS} == expected, name
    rec = recipe("gemma3")
    code, err = cli(["generate", rec], capsys)
    assert code == 0, err
    samples = {}
    for split in ("train", "held_out"):
        shards = HiddenStateShards(rec.parent / "run" / "hidden_states", split)
        samples.update({s["id"]: s for s in (shards[i] for i in range(len(shards)))})
    assert {"pictures:red", "pictures:blue"} <= set(samples) and not any(
        s.startswith("pictures:broken") for s in samples
    )
    target = load_target(TargetConfig(name_or_path=str(built("gemma3")), aux_layer_ids=AUX))
    processor = AutoProcessor.from_pretrained(built("gemma3"))
    image_token = target.tokenizer.convert_tokens_to_ids("<image_soft_token>")
    records = {r["id"]: r["messages"] for r in map(json.loads, data.read_text().splitlines())}
    for name in ("red", "blue"):
        sample, messages = samples[f"pictures:{name}"], records[name]
        ids, mask = sample["input_ids"], sample["loss_mask"]
        is_image = ids == image_token
        assert int(is_image.sum()) == 4 and not mask[is_image].any()  # one image of mm_tokens_per_image tokens
        parts = [p for m in messages if isinstance(m["content"], list) for p in m["content"]]
        urls = [p["image_url"]["url"] for p in parts if p["type"] == "image_url"]
        images = [load_image(u if u.startswith("data:") else str(data.parent / u)) for u in urls]
        for m in messages:
            if isinstance(m["content"], list):
                m["content"] = [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]]
        text = processor.apply_chat_template(messages, tokenize=False)
        inputs = processor(text=[text], images=images, add_special_tokens=False, return_tensors="pt")
        assert inputs["input_ids"][0].tolist() == ids.tolist()  # the processor's expansion, every turn in one sample
        with torch.no_grad():
            out = target.model(**inputs, output_hidden_states=True)
            plain = target.model(input_ids=ids[None], output_hidden_states=True)
        expected = torch.cat([out.hidden_states[i][0] for i in AUX], dim=-1)
        torch.testing.assert_close(sample["aux_hidden_states"], expected, rtol=1e-5, atol=1e-5)
        after = int(is_image.nonzero()[-1]) + 1  # past the image, the states depend on its pixels
        assert not torch.allclose(sample["hidden_state"][after:], plain.hidden_states[-1][0, after:], atol=1e-3)


def test_a_target_that_selects_its_keys_stores_each_samples_states_as_it_computes_them_alone(tmp_path, capsys):
    """DeepSeek-V3.2's indexer keeps the top `index_topk` keys by score, many of them tied: in a padded batch the
    row's width changes which tied keys it keeps, so states past `index_topk` drifted from the target's own (0.2 on
    a 2-layer one). `generate` runs such a target in batches of one length; a Llama-shaped target still pads. The
    verify loop, which has no cache or mask for the selection, refuses it when the recipe loads."""
    from speculators_train.architectures import pads_exactly
    from speculators_train.data.render import Sample
    from speculators_train.hidden_states.pipeline import capture, padded_batches
    from speculators_train.recipe import TargetConfig
    from speculators_train.target import load_target
    from tests.targets import ROUTED_MOE, Arch, config_of

    index = {"index_topk": 4, "index_n_heads": 2, "index_head_dim": 16}
    mla = {"kv_lora_rank": 32, "q_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 32}
    arch = Arch("deepseek-v3.2", "deepseek_v32", "deepseek", {**ROUTED_MOE, **mla, **index, "num_key_value_heads": 4})
    folder = build(arch, tmp_path / "v32")
    code, err = cli(["verify", matrix_recipe(tmp_path, folder, "eagle3")], capsys)
    assert code == 2 and "layer type 'indexed_attention' is not one the verify loop can mask" in err, err
    target = load_target(TargetConfig(name_or_path=str(folder), aux_layer_ids=AUX))
    assert not pads_exactly(target.config) and pads_exactly(config_of(BY_NAME["llama3"]))
    torch.manual_seed(0)
    samples = [Sample(f"s{n}", torch.randint(0, 2000, (n,)), torch.ones(n, dtype=torch.bool)) for n in (30, 19, 19, 12)]
    batches = [b for b, *_ in padded_batches(samples, 4096, torch.device("cpu"), pad=False)]
    assert sorted(map(sorted, batches)) == [[0], [1, 2], [3]]  # one length a batch
    del samples[2]  # a batch of two rows rounds otherwise than one: each stored row is compared alone, bit for bit
    stored = capture(target, samples, 4096, torch.float32)
    for sample, states in zip(samples, stored, strict=True):
        aux, final = target.hidden_states(sample.input_ids[None], None)
        assert torch.equal(states["hidden_state"], final[0]), sample.id
        assert torch.equal(states["aux_hidden_states"], aux[0]), sample.id


def test_deepseek_v4_head_weights_are_found_and_its_several_streams_refused_in_one_line(tmp_path, capsys):
    """A checkpoint transformers saved holds the model's own names, which DeepSeek-V4's renamings (written for its
    original checkpoint: `.norm.` is an attention norm there) would turn into names the model lacks: read as
    transformers' loader reads them, the final norm is found. Its decoder layers carry `hc_mult` residual streams,
    which no draft reads: `generate` refuses it in one line before writing anything."""
    from speculators_train.head import load_head_weights
    from speculators_train.recipe import TargetConfig
    from tests.targets import Arch

    v4 = {"num_key_value_heads": 1, "head_dim": 64, "q_lora_rank": 32, "o_lora_rank": 32, "o_groups": 2}
    v4 |= {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 64}
    v4 |= {"index_n_heads": 2, "index_head_dim": 16, "index_topk": 8, "sliding_window": 16, "qk_rope_head_dim": 16}
    v4 |= {"num_nextn_predict_layers": 0, "hc_mult": 2}
    target = build(Arch("deepseek-v4", "deepseek_v4", "deepseek", v4), tmp_path / "v4")
    _, weights = load_head_weights(TargetConfig(name_or_path=str(target)))
    assert {"embed", "lm_head", "norm.weight"} <= set(weights)
    recipe = matrix_recipe(tmp_path, target, "eagle3")
    assert cli(["data", recipe], capsys)[0] == 0
    code, err = cli(["generate", recipe], capsys)
    assert code == 2 and "output states of shape (" in err and "not [batch, tokens, hidden]" in err, err
    assert "Traceback" not in err and not list((tmp_path / "run" / "hidden_states").glob("*.safetensors"))
