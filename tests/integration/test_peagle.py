"""P-EAGLE with the real SmolLM2 target on real prompts: COD sampling at the paper's rates, the training forward
against one dense pass with speculators' mask, the proposer's single forward against training at the same anchor,
the loss normalisation, sampled proposals, greedy exactness, the export loaded by the `speculators` library's own
PEagleDraftModel, training, verify and online distillation."""

import json

import pytest
import torch
from safetensors.torch import load_file

from speculators_train.errors import UserError
from speculators_train.export.run import export
from speculators_train.families import get
from speculators_train.families.eagle.model import DraftCache, Eagle3Config
from speculators_train.families.peagle.model import PEagleConfig, PEagleDraft, sample_chains
from speculators_train.families.peagle.objective import parallel_loss
from speculators_train.families.vocab import build_vocab_mapping
from speculators_train.head import TargetHead
from speculators_train.proposal import TreeSpec
from speculators_train.recipe import load_recipe
from speculators_train.training.checkpoint import save_checkpoint
from speculators_train.verify.decoder import SpeculativeDecoder, decode_plain
from speculators_train.verify.run import eos_ids, load_draft_for
from tests.conftest import OWN_REPLIES, SHAREGPT, chat, make_recipe, tiny_config
from tests.integration.test_families import check_parallel_sampling
from tests.integration.test_osd_distill import fresh_draft_on_logs
from tests.integration.test_verify import GREEDY

MASK_ID = 2


def random_peagle(target, depths: int = 8, **norms: bool) -> PEagleDraft:
    """The real P-EAGLE architecture for SmolLM2 with random weights (norms and the mask row too, so a weight in
    the wrong slot shows), a 1024-id vocabulary of scattered ids plus the most common ones."""
    torch.manual_seed(0)
    base = Eagle3Config.for_target(target.config, target.aux_layer_ids, 1024, False, **norms)
    draft = PEagleDraft(PEagleConfig(**base.to_dict(), mask_token_id=MASK_ID, depths=depths))
    freq = torch.zeros(target.vocab_size)
    freq[torch.randperm(target.vocab_size)[:1024]] = 1
    freq[:256] = 2
    d2t, t2d = build_vocab_mapping(freq, 1024)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
        draft.embed_tokens.weight.copy_(target.embed_tokens.weight)
        draft.mask_embedding.normal_(0, 0.05)
    return draft.eval()


@pytest.fixture(scope="module")
def draft(target):
    return random_peagle(target)


@pytest.fixture(scope="module")
def conversation(target):
    """A prompt and the target's own greedy reply: (ids, aux states g_j [1, L, 3H])."""
    prompt = chat(target, "Explain what a hash table is in two sentences.")
    ids = prompt + decode_plain(target, prompt, 24, set(), GREEDY).tokens
    aux, _ = target.hidden_states(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
    return ids, aux


def test_cod_sampling_keeps_nested_chains_through_trained_targets_at_the_papers_rates():
    torch.manual_seed(0)
    trained = torch.rand(3, 300) < 0.8
    trained[1, 150:] = False  # a shorter row, as padding leaves it
    chains = sample_chains(trained, 8, 0.7, 0.2)
    assert len(chains.anchors) == 7
    per_depth = zip(chains.anchors, chains.present, chains.slots, strict=True)
    for d, (anchors, present, slots) in enumerate(per_depth, start=1):
        for b in range(3):
            kept = anchors[b][present[b]]
            assert torch.equal(kept, kept.sort().values) and kept.unique().numel() == kept.numel()
            # every depth-1..d target of the chain is trained, so it predicts assistant tokens all the way
            for e in range(1, d + 1):
                assert trained[b, kept + e].all()
            if d > 1:  # nested: a chain at depth d was kept at depth d - 1
                assert (chains.slots[d - 2][b, kept] >= 0).all()
            assert torch.equal(slots[b, kept], torch.arange(kept.numel()))
            n = int(trained[b].sum())
            pool = sum(bool(trained[b, j + 1 : j + d + 1].all()) and j + d < 300 for j in range(300))
            expected = int((n - d) * max(0.7**d, 0.2))
            # the paper's share of positions, unless fewer chains survive from the depth before
            assert kept.numel() == expected or (kept.numel() < expected and d > 1)
            assert kept.numel() <= pool
    everything = sample_chains(trained, 8, 0.7, 0.2, everything=True)
    for d, anchors in enumerate(everything.anchors, start=1):
        for b in range(3):
            all_chains = [j for j in range(300 - d) if trained[b, j + 1 : j + d + 1].all()]
            assert anchors[b][everything.present[d - 1][b]].tolist() == all_chains


def dense_logits(draft, tokens, aux, positions, chains, b: int) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """One dense pass over every element of row b with speculators' P-EAGLE mask (attend a depth-0 element at an
    anchor <= yours, or an element of your own chain at a depth <= yours): the logits per element."""
    length = tokens.shape[1]
    elems = [(j, 0) for j in range(length)]
    for d, (anchors, present) in enumerate(zip(chains.anchors, chains.present, strict=True), start=1):
        elems += [(int(a), d) for a, p in zip(anchors[b], present[b], strict=True) if p]
    anchor = torch.tensor([a for a, _ in elems])
    depth = torch.tensor([d for _, d in elems])
    allowed = ((depth[None] == 0) & (anchor[None] <= anchor[:, None])) | (
        (anchor[None] == anchor[:, None]) & (depth[None] <= depth[:, None])
    )
    real = depth == 0
    hidden = torch.where(real[:, None], draft.fuse(aux[b, anchor]), draft.fuse(draft.mask_hidden[0]))
    embeds = torch.where(real[:, None], draft.embed(tokens[b, anchor]), draft.mask_embedding)
    cos, sin = draft.rotary_emb(hidden, (positions[b, anchor] + depth)[None])
    out = draft.layers[0].decode(embeds[None], hidden[None], cos, sin, DraftCache(), allowed)
    return draft._outputs(out)[1][0], elems


@pytest.mark.parametrize("norm_before_fc", [False, True])
def test_the_training_forward_is_one_dense_pass_with_the_papers_mask(target, norm_before_fc):
    draft = random_peagle(target, depths=5, norm_before_fc=norm_before_fc)
    torch.manual_seed(1)
    length = 40
    tokens = torch.randint(0, 1000, (2, length))
    tokens[0, 7] = MASK_ID  # a real occurrence of the mask id reads the trained mask row, as in every engine
    aux = torch.randn(2, length, draft.fc.in_features) * 3
    positions = torch.arange(1, length + 1).expand(2, -1)
    trained = torch.rand(2, length) < 0.85
    chains = sample_chains(trained, 5, 0.7, 0.2)
    with torch.no_grad():
        mine = draft.parallel_forward(tokens, aux, positions, chains)
        for b in range(2):
            dense, elems = dense_logits(draft, tokens, aux, positions, chains, b)
            torch.testing.assert_close(mine[0][b], dense[:length], rtol=1e-4, atol=1e-4)
            at = length
            for d, present in enumerate(chains.present, start=1):
                n = int(present[b].sum())
                assert elems[at][1] == d
                torch.testing.assert_close(mine[d][b, :n], dense[at : at + n], rtol=1e-4, atol=1e-4)
                at += n
    assert draft.embed(torch.tensor([MASK_ID, 5]))[0].equal(draft.mask_embedding)


def test_one_proposer_forward_drafts_what_training_scores_at_the_same_anchor(target, draft, conversation):
    """After each commit, the proposer's depth 0 and K - 1 mask slots (one forward, cached keys of the committed
    pairs) give the logits the training forward gives the chain anchored at the last committed pair."""
    ids, aux = conversation
    tokens, states = torch.tensor([ids[1:]]), aux[:, :-1]
    length = tokens.shape[1]
    chains = sample_chains(torch.ones(1, length, dtype=torch.bool), 8, 0.7, 0.2, everything=True)
    with torch.no_grad():
        trained = draft.parallel_forward(tokens, states, torch.arange(1, length + 1)[None], chains)
    proposer = get("peagle").proposer(draft, target)
    done = 0
    for upto in (length - 20, length - 14, length - 13):  # a prefill, then commits of 6 and 1 pairs
        proposer.extend(ids[done + 1 : upto + 1], states[0, done:upto])
        done = upto
        logits = proposer.logits(8)
        anchor = upto - 1
        torch.testing.assert_close(logits[0], trained[0][0, anchor], rtol=1e-4, atol=1e-4)
        for d in range(1, 8):
            slot = int(chains.slots[d - 1][0, anchor])
            torch.testing.assert_close(logits[d], trained[d][0, slot], rtol=1e-4, atol=1e-4)
    assert proposer.committed == done and len(proposer.cache) == done  # no mask slot stays cached


def test_the_loss_is_the_mean_over_every_scored_element_of_every_depth(target, draft, conversation):
    """No per-depth weight and one count for all depths: loss = sum of per-element divergences / their count."""
    from speculators_train.head import load_head_weights

    ids, aux = conversation
    config, weights = load_head_weights(tiny_config())
    head = TargetHead.from_weights(config, weights)
    _, final = target.hidden_states(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
    mask = torch.zeros(1, len(ids), dtype=torch.bool)
    mask[0, len(ids) - 24 :] = True
    batch = {"input_ids": torch.tensor([ids]), "aux_hidden_states": aux, "hidden_state": final, "loss_mask": mask}
    for training in (False, True):
        torch.manual_seed(0)
        with torch.no_grad():
            loss, sums = parallel_loss(draft, batch, head, 6, (0.7, 0.2), "forward_kl", training)
        numerators = sum(float(sums[f"loss_{d}"][0]) for d in range(6))
        counts = sum(float(sums[f"loss_{d}"][1]) for d in range(6))
        assert counts > float(sums["loss_0"][1]) > 0  # deeper depths are scored too
        assert float(loss) == pytest.approx(numerators / counts, rel=1e-5)
        for d in range(6):  # a chain right at depth d was right at every depth before it
            assert float(sums[f"full_acc_{d}"][0]) <= float(sums[f"acc_{d}"][0]) + 1e-9


def test_sampled_peagle_proposals_come_from_the_distributions_they_report(target, draft, conversation):
    ids, aux = conversation
    proposer = get("peagle").proposer(draft, target)
    proposer.extend(ids[1:30], aux[0, :29])
    check_parallel_sampling(proposer, draft, target.vocab_size, draws=2000)


@pytest.mark.parametrize("tree", [None, TreeSpec(top_k=3, depth=4, budget=10)], ids=["chain", "tree"])
def test_greedy_peagle_output_is_the_targets_own(target, draft, tree):
    prompt = chat(target, "Write a Python function that reverses a string.")
    reference = decode_plain(target, prompt, 32, eos_ids(target), GREEDY).tokens
    decoder = SpeculativeDecoder(target, get("peagle").proposer(draft, target), GREEDY, 5, tree=tree)
    assert decoder.generate(prompt, 32, eos_ids(target)).tokens == reference


@pytest.mark.parametrize("norm_before_fc", [False, True])
def test_speculators_library_loads_our_peagle_export_and_computes_the_same_logits(
    tmp_path, target, conversation, monkeypatch, norm_before_fc
):
    """speculators 0.9.0's PEagleDraftModel reads our export (mask_hidden, the trained mask row in embed_tokens,
    mask_token_id) and its training forward, given our chains, gives our logits at every depth."""
    import speculators.models.peagle.core as their_core
    from speculators.losses import resolve_loss_config
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig

    from speculators_train.origin import resolve_origin

    draft = random_peagle(target, depths=4, norm_before_fc=norm_before_fc)
    recipe = load_recipe(
        make_recipe(tmp_path, [{"name": "s", "path": SHAREGPT, "max_records": 8}], draft={"family": "peagle"})
    )
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, draft, None, {"step": 1}, keep_last=1)
    out = export(recipe, checkpoint, "speculators", tmp_path / "spec", "float32").path
    written = json.loads((out / "config.json").read_text())
    assert written["speculators_model_type"] == "peagle" and written["mask_token_id"] == MASK_ID
    assert written["architectures"] == ["PEagleSpeculator"] and written["speculators_config"]["algorithm"] == "peagle"
    assert written["transformer_layer_config"]["model_type"] == "llama"  # vLLM: Eagle3LlamaForCausalLM
    tensors = load_file(out / "model.safetensors")
    assert tensors["mask_hidden"].shape == (1, 1, draft.fc.in_features) and "mask_embedding" not in tensors
    embed = tensors["embed_tokens.weight"]
    assert embed[MASK_ID].equal(draft.mask_embedding.detach())
    others = torch.arange(embed.shape[0]) != MASK_ID
    assert embed[others].equal(target.embed_tokens.weight[others])

    config = PEagleSpeculatorConfig.from_pretrained(out)
    config.speculators_config.verifier.name_or_path = resolve_origin(recipe.target)[0]  # offline: the local copy
    config.transformer_layer_config._attn_implementation = "sdpa"
    theirs = PEagleDraftModel.from_pretrained(out, config=config).eval()
    assert theirs.mask_token_id == MASK_ID
    assert set(theirs.state_dict()) - set(tensors) == {"verifier_norm.weight", "verifier_lm_head.weight"}
    assert not any(p.isnan().any() for p in theirs.parameters())

    ids, aux = conversation
    tokens, states = torch.tensor([ids[1:]]), aux[:, :-1]
    length = tokens.shape[1]
    chains = sample_chains(torch.ones(1, length, dtype=torch.bool), 4, 0.7, 0.2)
    anchor_pos = torch.cat([torch.arange(length), *[a[p] for a, p in zip(chains.anchors, chains.present, strict=True)]])
    depth = torch.cat([torch.full((int(p.sum()),), d) for d, p in enumerate([torch.ones(length), *chains.present])])
    monkeypatch.setattr(their_core, "generate_cod_sample_indices", lambda **_: (anchor_pos, depth))
    captured = []
    hook = theirs.lm_head.register_forward_hook(lambda _m, _a, out: captured.append(out.detach()))
    with torch.no_grad():
        theirs(
            hidden_states=states,
            input_ids=tokens,
            document_ids=torch.zeros_like(tokens),
            loss_mask=torch.ones_like(tokens),
            verifier_last_hidden_states=torch.randn(1, length, target.config.hidden_size),
            num_depths=4,
            loss_config=resolve_loss_config("kl_div", "eager"),  # their fused loss needs Triton
        )
        loaded = load_draft_for(target, out).draft
        mine = loaded.parallel_forward(tokens, states, torch.arange(1, length + 1)[None], chains)
    hook.remove()
    (their_logits,) = captured
    torch.testing.assert_close(their_logits[0, :length], mine[0][0], rtol=1e-4, atol=1e-4)
    at = length
    for d, present in enumerate(chains.present, start=1):
        n = int(present.sum())
        torch.testing.assert_close(their_logits[0, at : at + n], mine[d][0, :n], rtol=1e-4, atol=1e-4)
        at += n


def test_peagle_export_refusals_name_what_is_wrong(tmp_path, target, draft):
    from safetensors.torch import save_file

    path = make_recipe(tmp_path, [{"name": "s", "path": SHAREGPT, "max_records": 8}], draft={"family": "peagle"})
    for override, words in (
        ({"export.format": "sglang"}, "sglang"),
        ({"export.format": "gguf"}, "gguf"),
        ({"eval.engine": "llama.cpp"}, "no P-EAGLE runtime"),
        ({"training.gradient_checkpointing": True}, "does not checkpoint"),
    ):
        with pytest.raises(UserError, match=words):
            load_recipe(path, override)
    recipe = load_recipe(path)
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, draft, None, {"step": 1}, keep_last=1)
    out = export(recipe, checkpoint, "speculators", tmp_path / "spec", "float32").path
    tensors = load_file(out / "model.safetensors")
    del tensors["mask_hidden"]
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(UserError, match="mask_hidden"):
        load_draft_for(target, out)
    config = json.loads((out / "config.json").read_text())
    del config["mask_token_id"]
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match="mask_token_id"):
        load_draft_for(target, out)


def test_a_trained_peagle_draft_beats_its_start_verifies_exactly_and_exports(tmp_path, own_states):
    import shutil

    from speculators_train.training.trainer import Trainer
    from speculators_train.verify.run import verify

    peagle = {"family": "peagle", "draft_vocab_size": 1024, "depths": 4}
    train = {"epochs": 6, "batch_size": 4, "learning_rate": 3e-3, "warmup_ratio": 0.0, "wandb": {"mode": "disabled"}}
    path = make_recipe(
        tmp_path,
        [{"name": "sharegpt", "path": SHAREGPT, "max_records": 20}],
        draft=peagle,
        data=OWN_REPLIES,
        training=train,
        eval={"num_speculative_tokens": 4, "num_prompts": 2, "max_new_tokens": 16},
    )
    shutil.copytree(own_states, tmp_path / "run" / "hidden_states")
    recipe = load_recipe(path)
    trainer = Trainer(recipe)
    before = trainer.validate()
    after = trainer.train()
    assert after["predicted_al_4"] > before["predicted_al_4"] + 0.05
    assert after["predicted_al_4"] == pytest.approx(1 + sum(after[f"full_acc_{d}"] for d in range(4)))
    assert after["acc_1"] > before["acc_1"]  # the mask slots learn, not only depth 0
    _, records = verify(recipe, tmp_path / "run", tmp_path / "verify")
    assert all(r["greedy_identical_outputs"] == "2/2" for r in records)
    out = export(recipe, tmp_path / "run", "speculators", tmp_path / "out").path
    assert "parallel_drafting" in (out / "README.md").read_text()


def test_online_distillation_adapts_a_peagle_draft_through_the_shared_step(tmp_path, target):
    from speculators_train.osd.distill import OnlineDistiller

    settings = {"family": "peagle", "depths": 3, "draft_vocab_size": 2048}
    recipe, logs, _ = fresh_draft_on_logs(tmp_path, target, settings, target.aux_layer_ids)
    (first,) = OnlineDistiller(recipe, logs, target).run()
    assert first["promoted"], first["reason"]
    assert first["candidate_log_al"] > first["log_al"] >= 1.0
    written = json.loads((recipe.run_dir / "osd" / "current" / "speculators" / "config.json").read_text())
    assert written["speculators_model_type"] == "peagle"
