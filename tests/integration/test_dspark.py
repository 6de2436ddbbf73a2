"""DSpark with the real SmolLM2 target on real prompts: the export loaded by the `speculators` library's own
DSparkDraftModel gives our Markov-biased logits and confidences for every Markov head kind, the proposer chains each
slot on the token it drafted before (what training's bias reads at the real tokens), the confidence head stops a
chain at eval.draft_p_min, sampled drafts report the q they were drawn from, refusals, and training."""

import json

import pytest
import torch

from speculators_train.errors import UserError
from speculators_train.export.run import export
from speculators_train.families import get
from speculators_train.families.dspark.model import DSparkDraft
from speculators_train.proposal import Sampling
from speculators_train.recipe import load_recipe
from speculators_train.training.checkpoint import save_checkpoint
from speculators_train.verify.decoder import SpeculativeDecoder, decode_plain
from speculators_train.verify.run import eos_ids, load_draft_for
from tests.conftest import OWN_REPLIES, SHAREGPT, chat, make_recipe, tiny_config
from tests.integration import test_dflash
from tests.integration.test_dflash import MASK_ID, randomized, their_backbone
from tests.integration.test_verify import GREEDY

conversation = test_dflash.conversation  # the prompt and reply DFlash's tests use, per module


def random_dspark(target, kind: str = "vanilla", block_size: int = 6, rank: int = 24) -> DSparkDraft:
    """The real DSpark architecture for SmolLM2 with random weights (norms too, and a Markov head large enough to
    move argmaxes) and a 1024-id vocabulary of scattered ids plus the most common ones."""
    torch.manual_seed(0)
    settings = get("dspark").settings(
        family="dspark",
        markov_rank=rank,
        markov_head_type=kind,
        num_layers=2,
        block_size=block_size,
        mask_token_id=MASK_ID,
    )
    draft = DSparkDraft(get("dspark").draft_config(settings, target.config, target.aux_layer_ids, 1024))
    with torch.no_grad():
        draft.markov_head.markov_w1.weight.normal_(0, 1.0)
    return randomized(draft, target)


def exported(tmp_path, draft) -> tuple:
    recipe = load_recipe(
        make_recipe(tmp_path, [{"name": "s", "path": SHAREGPT, "max_records": 8}], draft={"family": "dspark"})
    )
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, draft, None, {"step": 1}, keep_last=1)
    return recipe, export(recipe, checkpoint, "speculators", tmp_path / "spec", "float32").path


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_speculators_library_loads_our_dspark_export_and_computes_the_same_logits(tmp_path, target, conversation, kind):
    """speculators 0.9.0's DSparkDraftModel reads our export; its backbone and heads, applied as its own forward
    applies them (slot k biased by the block's token at k, the confidence head on [h; w1[prev]]), give our logits
    and confidences at every slot of every block."""
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig

    from speculators_train.origin import resolve_origin

    draft = random_dspark(target, kind, block_size=4)
    recipe, out = exported(tmp_path, draft)
    written = json.loads((out / "config.json").read_text())
    assert written["speculators_model_type"] == "dspark" and written["architectures"] == ["DSparkSpeculator"]
    assert written["speculators_config"]["algorithm"] == "dspark"
    assert (written["sample_from_anchor"], written["markov_rank"], written["markov_head_type"]) == (True, 24, kind)
    assert written["enable_confidence_head"] is True and written["confidence_head_with_markov"] is True

    config = DSparkSpeculatorConfig.from_pretrained(out)
    config.speculators_config.verifier.name_or_path = resolve_origin(recipe.target)[0]  # offline: the local copy
    config.transformer_layer_config._attn_implementation = "eager"
    theirs = DSparkDraftModel.from_pretrained(out, config=config).eval()
    with torch.no_grad():
        theirs.embed_tokens.weight.copy_(target.embed_tokens.weight)

    ids, aux, _ = conversation
    with torch.no_grad():
        anchors, (hidden, logits, _, _, indices) = their_backbone(theirs, conversation, 4)
        blocks = hidden.view(anchors.numel(), 4, -1)
        previous = torch.tensor([ids])[0, indices].view(anchors.numel(), 4)  # their forward's prev_token_ids
        embedded = theirs.markov_head.prev_embeddings(previous)
        bias = theirs.markov_head.block_bias(prev_token_ids=previous, hidden_states=blocks, prev_emb=embedded)
        their_logits = logits.view(anchors.numel(), 4, -1) + bias
        their_confidence = theirs.confidence_head(torch.cat([blocks, embedded], dim=-1))

        loaded = load_draft_for(target, out).draft
        normed = loaded.training_forward(torch.tensor([ids]), aux, anchors[None], logits=False)[0]
        mine = previous.clone()
        mine_logits = loaded.slot_logits(normed, mine)
        mine_confidence = loaded.confidence_logits(normed, mine)
    assert torch.equal(previous[:, 0], anchors.new_tensor(ids)[anchors])  # slot 0 reads the anchor
    torch.testing.assert_close(their_logits, mine_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(their_confidence, mine_confidence, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["vanilla", "rnn"])
def test_the_proposer_chains_each_slot_on_the_token_it_drafted_before(target, conversation, kind):
    """One forward gives the slots of training's block at that anchor (slot 0 proposes); the chain's tokens are
    the argmaxes of training's slot logits when the previous tokens are the anchor and the chain's own drafts. The
    Markov head moves drafts here, so a proposer reading the real previous token, or none, would differ."""
    draft = random_dspark(target, kind)
    ids, aux, _ = conversation
    anchor = len(ids) - 12
    with torch.no_grad():
        trained = draft.training_forward(torch.tensor([ids]), aux, torch.tensor([[anchor]]), logits=False)[0, 0]
    proposer = get("dspark").proposer(draft, target)
    proposer.reset(ids[0])
    proposer.extend(ids[1 : anchor + 1], aux[0, :anchor])
    normed = proposer.outputs(6, logits=False)
    torch.testing.assert_close(normed, trained, rtol=1e-4, atol=1e-4)
    drafts, q = proposer.propose_chain(6, GREEDY, None)
    assert q is None and len(drafts) == 6
    previous = torch.tensor([ids[anchor], *drafts[:-1]])
    with torch.no_grad():
        chained = draft.slot_logits(normed, previous).argmax(-1)
        unbiased = draft.lm_head(normed).argmax(-1)
    assert proposer.targets[chained].tolist() == drafts
    assert proposer.targets[unbiased].tolist() != drafts  # the head matters for this draft


def test_the_confidence_head_stops_a_chain_below_p_min_and_the_output_stays_the_targets(target, conversation):
    draft = random_dspark(target)
    ids, aux, _ = conversation
    proposer = get("dspark").proposer(draft, target)
    proposer.reset(ids[0])
    proposer.extend(ids[1:30], aux[0, :29])
    drafts, _ = proposer.propose_chain(6, GREEDY, None)
    normed = proposer.outputs(6, logits=False)
    previous = torch.tensor([ids[29], *drafts[:-1]])
    with torch.no_grad():
        confidence = torch.sigmoid(draft.confidence_logits(normed, previous)).tolist()
    for p_min in sorted(confidence)[1:4]:  # stops before the first slot below it, drafting the same tokens before
        stop = next(i for i, c in enumerate(confidence) if c < p_min)
        assert proposer.propose_chain(6, Sampling(p_min=p_min), None)[0] == drafts[:stop]
    assert proposer.propose_chain(6, Sampling(p_min=0.999), None) == ([], None) or min(confidence) >= 0.999

    prompt = chat(target, "Write a Python function that reverses a string.")
    reference = decode_plain(target, prompt, 24, eos_ids(target), GREEDY).tokens
    for p_min in (0.0, sorted(confidence)[3]):
        sampling = Sampling(p_min=p_min)
        decoder = SpeculativeDecoder(target, get("dspark").proposer(draft, target), sampling, 6)
        assert decoder.generate(prompt, 24, eos_ids(target)).tokens == reference


def test_sampled_dspark_drafts_report_the_distribution_each_was_drawn_from(target, conversation):
    """At T > 0 with sampled drafts, row i of q is softmax((base + Markov bias of the token drawn at i - 1) / T)
    over the draft vocabulary: the q the rejection rule needs, given the drafts before it."""
    from speculators_train.families.vocab import draft_to_target

    draft = random_dspark(target, "rnn")
    ids, aux, _ = conversation
    proposer = get("dspark").proposer(draft, target)
    proposer.reset(ids[0])
    proposer.extend(ids[1:30], aux[0, :29])
    normed = proposer.outputs(4, logits=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        tokens, q = proposer.propose_chain(4, Sampling(0.8, draft_sampling="sample"), g)
        with torch.no_grad():
            logits = draft.slot_logits(normed, torch.tensor([ids[29], *tokens[:-1]])).float()
        expected = torch.zeros_like(q)
        expected[:, draft_to_target(draft.d2t)] = torch.softmax(logits / 0.8, dim=-1)
        torch.testing.assert_close(q, expected)
        assert all(q[i, t] > 0 for i, t in enumerate(tokens))


def test_dspark_refusals_name_what_is_wrong(tmp_path, target):
    path = make_recipe(tmp_path, [{"name": "s", "path": SHAREGPT, "max_records": 8}], draft={"family": "dspark"})
    load_recipe(path, {"export.format": "gguf", "eval.engine": "llama.cpp", "eval.draft_p_min": 0.5})
    for override, words in (
        ({"draft.markov_rank": 0}, "confidence_head_with_markov needs a Markov head"),
        ({"draft.markov_head_type": "rnn", "export.format": "gguf"}, "llama.cpp runs the vanilla Markov head only"),
        ({"draft.confidence_head": False, "eval.draft_p_min": 0.5}, "eval.draft_p_min stops a DSpark chain"),
        ({"eval.mode": "tree"}, "verify chains"),
    ):
        with pytest.raises(UserError, match=words):
            load_recipe(path, override)
    flash = make_recipe(tmp_path / "f", [{"name": "s", "path": SHAREGPT, "max_records": 8}], draft={"family": "dflash"})
    with pytest.raises(UserError, match="this loop stops chains only by a confidence head"):
        load_recipe(flash, {"eval.draft_p_min": 0.5})
    with pytest.raises(UserError, match="vLLM has no such stop"):
        load_recipe(path, {"eval.draft_p_min": 0.5, "eval.engine": "vllm"})
    _, out = exported(tmp_path / "e", random_dspark(target))
    config = json.loads((out / "config.json").read_text())
    for change, words in (
        ({"sample_from_anchor": False}, "sample_from_anchor is false"),
        ({"markov_head_type": "lstm"}, "markov_head_type"),
        ({"enable_confidence_head": "yes"}, "enable_confidence_head"),
        ({"markov_rank": 0}, "confidence_head_with_markov is true without a Markov head"),
    ):
        (out / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(UserError, match=words):
            load_draft_for(target, out)


def test_a_trained_dspark_draft_beats_its_start_predicts_its_acceptance_verifies_exactly_and_exports(
    tmp_path, own_states
):
    """What only this proves: the Markov and confidence heads train with the backbone through the trainer (the
    confidence head's error against the analytical acceptance falls), and verify and export take the result."""
    import shutil

    from speculators_train.training.trainer import Trainer
    from speculators_train.verify.run import verify

    dspark = {
        "family": "dspark",
        "draft_vocab_size": 1024,
        "block_size": 4,
        "num_layers": 1,
        "mask_token_id": 16,
        "markov_rank": 32,
    }
    train = {"epochs": 6, "batch_size": 1, "learning_rate": 1e-3, "warmup_ratio": 0.0, "wandb": {"mode": "disabled"}}
    path = make_recipe(
        tmp_path,
        [{"name": "sharegpt", "path": SHAREGPT, "max_records": 20}],
        draft=dspark,
        data=OWN_REPLIES,
        training=train,
        eval={"num_speculative_tokens": 4, "num_prompts": 2, "max_new_tokens": 16, "draft_p_min": 0.05},
    )
    shutil.copytree(own_states, tmp_path / "run" / "hidden_states")
    recipe = load_recipe(path)
    trainer = Trainer(recipe)
    before = trainer.validate()
    after = trainer.train()
    # measured on the session target's own replies: AL(4) 1.048 -> 1.112, acc_0 0.048 -> 0.079, acc_1 0 -> 0.049,
    # confidence error 0.45 -> 0.14
    assert after["predicted_al_4"] > before["predicted_al_4"] + 0.025
    assert after["acc_0"] > 1.5 * before["acc_0"] and after["acc_1"] > before["acc_1"]  # slot 0 proposes and learns
    assert after["confidence_error"] < before["confidence_error"] / 3
    _, records = verify(recipe, tmp_path / "run", tmp_path / "verify")
    assert all(r["greedy_identical_outputs"] == "2/2" for r in records)
    out = export(recipe, tmp_path / "run", "speculators", tmp_path / "out").path
    assert '"method": "dspark"' in (out / "README.md").read_text()


@pytest.mark.parametrize("family", ["dflash", "dspark"])
def test_a_full_vocabulary_block_draft_keeps_the_targets_head_which_speculators_runs(tmp_path, target, family):
    """Over the whole vocabulary speculators' DFlash models replace the file's lm_head with the verifier's on load
    (and llama.cpp's converter drops it): the draft starts from the target's head and never trains it, so every
    engine runs the head we trained with."""
    from speculators.models.dflash import DFlashDraftModel
    from speculators.models.dspark import DSparkDraftModel

    from speculators_train.head import load_head_weights
    from speculators_train.origin import resolve_origin
    from tests.conftest import start_of

    fam = get(family)
    settings = fam.settings(family=family, **{**fam.settings.small.settings, "draft_vocab_size": target.vocab_size})
    config, weights = load_head_weights(tiny_config())
    draft = fam.new_draft(settings, start_of(config, weights, torch.ones(target.vocab_size), target.aux_layer_ids))
    assert not draft.lm_head.weight.requires_grad
    assert torch.equal(draft.lm_head.weight, target.lm_head.weight.to(draft.lm_head.weight.dtype).cpu())
    recipe = load_recipe(
        make_recipe(tmp_path, [{"name": "s", "path": SHAREGPT, "max_records": 8}], draft={"family": family})
    )
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, draft, None, {"step": 1}, keep_last=1)
    out = export(recipe, checkpoint, "speculators", tmp_path / "spec", "float32").path
    written = json.loads((out / "config.json").read_text())
    written["speculators_config"]["verifier"]["name_or_path"] = resolve_origin(recipe.target)[0]
    (out / "config.json").write_text(json.dumps(written))
    theirs = {"dflash": DFlashDraftModel, "dspark": DSparkDraftModel}[family].from_pretrained(out)
    assert torch.equal(theirs.lm_head.weight, draft.lm_head.weight)
