"""DFlash with the real SmolLM2 target on real prompts: anchor sampling, the training forward against one dense
pass with speculators' anchor-block mask, the proposer's single forward against training at the same anchor, the
position weights, sampled proposals, greedy exactness, the export loaded by the `speculators` library's own
DFlashDraftModel, refusals, training, verify and online distillation."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb, repeat_kv

from speculators_train.errors import UserError
from speculators_train.export.run import export
from speculators_train.families import get
from speculators_train.families.block.model import DFlashConfig, DFlashDraft
from speculators_train.families.block.objective import block_loss, dpace_weights, sample_anchors
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

MASK_ID = 16


def random_dflash(target, block_size: int = 8, layers: int = 2) -> DFlashDraft:
    """The real DFlash architecture for SmolLM2 with random weights (norms too, so a weight in the wrong slot shows)
    and a 1024-id vocabulary of scattered ids plus the most common ones."""
    torch.manual_seed(0)
    config = DFlashConfig.for_target(target.config, target.aux_layer_ids, 1024, block_size, layers, MASK_ID)
    return randomized(DFlashDraft(config), target)


def randomized(draft: DFlashDraft, target) -> DFlashDraft:
    """`draft` with norms drawn in 0.5..1.5 (so a weight in the wrong slot shows), the target's embedding, and a
    1024-id vocabulary of scattered ids plus the 256 first ones, placed on the target's device."""
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
    return draft.to(target.device).eval()


@pytest.fixture(scope="module")
def draft(target):
    return random_dflash(target)


@pytest.fixture(scope="module")
def conversation(target):
    """A prompt and the target's own greedy reply: (ids, aux states g_t [1, L, 3H], pre-norm final states)."""
    prompt = chat(target, "Explain what a hash table is in two sentences.")
    ids = prompt + decode_plain(target, prompt, 24, set(), GREEDY).tokens
    aux, final = target.hidden_states(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
    return ids, aux, final


def test_anchors_are_candidates_drawn_without_replacement_and_every_one_in_validation():
    torch.manual_seed(0)
    candidates = torch.rand(3, 200) < 0.6
    candidates[2] = False  # a row without an assistant token
    anchors, present = sample_anchors(candidates, 50)
    for b in range(3):
        kept = anchors[b][present[b]]
        assert torch.equal(kept, kept.sort().values) and kept.unique().numel() == kept.numel()
        assert candidates[b, kept].all()
        assert kept.numel() == min(50, int(candidates[b].sum()))
    everything, present = sample_anchors(candidates, None)
    for b in range(3):
        assert everything[b][present[b]].tolist() == torch.nonzero(candidates[b]).flatten().tolist()
    draws = {tuple(sample_anchors(candidates, 50)[0][0].tolist()) for _ in range(3)}
    assert len(draws) == 3  # drawn afresh each time, not the first 50


def dense_logits(draft, tokens, aux, anchors) -> torch.Tensor:
    """One dense pass per layer over [context ; every block's slots] with speculators' anchor-block mask (a slot sees
    context positions before its anchor and every slot of its own block), keys and values projected from the
    concatenation as speculators' Qwen3DFlashAttention does: logits [n, S, D] of row 0."""
    size = draft.config.block_size
    length, n = tokens.shape[1], anchors.numel()
    ctx = draft.hidden_norm(draft.fc(aux[0]))  # [L, H]
    ids = torch.full((n, size), MASK_ID)
    ids[:, 0] = tokens[0, anchors]
    h = draft.embed_tokens(ids).reshape(n * size, -1)
    slot_anchor = anchors.repeat_interleave(size)
    positions = torch.cat([torch.arange(length), (anchors[:, None] + torch.arange(size)).flatten()])
    sees_context = torch.arange(length)[None] < slot_anchor[:, None]
    block = torch.arange(n).repeat_interleave(size)
    mask = torch.cat([sees_context, block[:, None] == block[None]], dim=1)  # [nS, L + nS]
    cos, sin = draft.rotary_emb(h[None], positions[None])
    for layer in draft.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        both = torch.cat([ctx, x])
        q = attn.q_norm(attn.q_proj(x).view(n * size, -1, attn.head_dim)).transpose(0, 1)[None]
        k = attn.k_norm(attn.k_proj(both).view(length + n * size, -1, attn.head_dim)).transpose(0, 1)[None]
        v = attn.v_proj(both).view(length + n * size, -1, attn.head_dim).transpose(0, 1)[None]
        q_full = torch.cat([torch.zeros(1, q.shape[1], length, attn.head_dim), q], dim=2)
        q_full, k = apply_rotary_pos_emb(q_full, k, cos, sin)
        groups = attn.heads // attn.kv_heads
        out = F.scaled_dot_product_attention(
            q_full[:, :, length:], repeat_kv(k, groups), repeat_kv(v, groups), attn_mask=mask, scale=attn.scaling
        )
        h = h + attn.o_proj(out[0].transpose(0, 1).reshape(n * size, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return draft.lm_head(draft.norm(h)).view(n, size, -1)[:, 1:]  # slot 0, the anchor, proposes nothing


def test_the_training_forward_is_one_dense_pass_with_speculators_anchor_block_mask(target):
    draft = random_dflash(target, block_size=5, layers=2).cpu()  # synthetic tensors against a CPU reference
    torch.manual_seed(1)
    length = 40
    tokens = torch.randint(0, 1000, (2, length))
    tokens[0, 9] = MASK_ID  # a real occurrence of the mask id as an anchor embeds like a mask slot, as in vLLM
    aux = torch.randn(2, length, draft.fc.in_features) * 3
    anchors = torch.tensor([[0, 9, 10, 30], [3, 4, 5, 38]])
    with torch.no_grad():
        mine = draft.training_forward(tokens, aux, anchors)
        for b in range(2):
            dense = dense_logits(draft, tokens[b : b + 1], aux[b : b + 1], anchors[b])
            torch.testing.assert_close(mine[b], dense, rtol=1e-4, atol=1e-4)
        # the block is bidirectional: a later slot's input changes an earlier slot's logits
        moved = tokens.clone()
        moved[0, 9] = 5
        assert not torch.allclose(draft.training_forward(moved, aux, anchors)[0, 1, 0], mine[0, 1, 0])
        # and a block never sees the state at its anchor or after it
        later = aux.clone()
        later[0, 10:] += 1
        torch.testing.assert_close(draft.training_forward(tokens, later, anchors)[0, :3], mine[0, :3])


def test_one_proposer_forward_drafts_what_training_scores_at_the_same_anchor(target, draft, conversation):
    """After each commit, the proposer's block (cached context keys of every verified state, the bonus token as
    anchor) gives the logits of the training forward's block at that anchor, mask slots 1..B-1."""
    ids, aux, _ = conversation
    length = len(ids)
    anchors = torch.tensor([[length - 20, length - 14, length - 13]])
    with torch.no_grad():
        trained = draft.training_forward(torch.tensor([ids], device=aux.device), aux, anchors.to(aux.device))
    proposer = get("dflash").proposer(draft, target)
    proposer.reset(ids[0])
    done = 0
    for i, anchor in enumerate(anchors[0].tolist()):  # a prefill, then commits of 6 and 1 tokens
        proposer.extend(ids[done + 1 : anchor + 1], aux[0, done:anchor])
        done = anchor
        logits = proposer.logits(7)
        torch.testing.assert_close(logits, trained[0, i], rtol=1e-4, atol=1e-4)
    assert proposer.length == done  # only verified states are kept, never a block's slots
    shorter = proposer.logits(3)  # vLLM runs k + 1 slots for k draft tokens: a smaller block, other logits
    assert shorter.shape[0] == 3 and not torch.allclose(shorter, trained[0, 2, :3])


def test_position_weights_decay_or_follow_dpace_and_the_loss_is_their_mean(target, draft, conversation):
    confidence = torch.tensor([[0.5, 0.8, 0.1, 0.9]])
    scored = torch.tensor([[True, True, False, True]])
    smooth = [0.75, 0.9, 1.0, 0.95]  # (1 - 0.5) c + 0.5 where scored, 1 elsewhere
    reach = [0.75, 0.75 * 0.9, 0.0, 0.75 * 0.9 * 0.95]  # prefix products, 0 where not scored
    expected = [sum(reach[i:]) if scored[0, i] else 0.0 for i in range(4)]
    assert smooth[1] == pytest.approx(0.5 * 0.8 + 0.5)
    torch.testing.assert_close(dpace_weights(confidence, scored, 0.5), torch.tensor([expected]))

    from speculators_train.head import load_head_weights

    ids, aux, final = conversation
    config, weights = load_head_weights(tiny_config())
    head = TargetHead.from_weights(config, weights).to(aux.device)
    mask = torch.zeros(1, len(ids), dtype=torch.bool, device=aux.device)
    mask[0, len(ids) - 24 :] = True
    ids_ = torch.tensor([ids], device=aux.device)
    batch = {"input_ids": ids_, "aux_hidden_states": aux, "hidden_state": final, "loss_mask": mask}
    with torch.no_grad():
        loss, sums = block_loss(draft, batch, head, 7, ("exp_decay", 4.0, 0.5), 512, "ce", False)
    numerators = [float(sums[f"loss_{d}"][0]) for d in range(7)]
    counts = [float(sums[f"loss_{d}"][1]) for d in range(7)]
    trained = [float(sums[f"acc_{d}"][1]) for d in range(7)]
    assert trained[0] == 23 and trained[6] == 17  # 23 anchors have a trained x_{a+1}, 17 a trained x_{a+7}
    assert 0 < counts[0] <= 23  # scored: trained and inside the draft vocabulary
    weighted = sum(torch.exp(torch.tensor(-d / 4.0)).item() * numerators[d] for d in range(7))
    assert float(loss) == pytest.approx(weighted / sum(counts), rel=1e-5)
    for d in range(1, 7):  # a block right at position d was right at every position before it
        assert float(sums[f"full_acc_{d}"][0]) <= float(sums[f"full_acc_{d - 1}"][0])


def test_sampled_dflash_proposals_come_from_the_distributions_they_report(target, draft, conversation):
    ids, aux, _ = conversation
    proposer = get("dflash").proposer(draft, target)
    proposer.reset(ids[0])
    proposer.extend(ids[1:30], aux[0, :29])
    check_parallel_sampling(proposer, draft, target.vocab_size, draws=1500)


@pytest.mark.parametrize("tree", [None, TreeSpec(top_k=3, depth=4, budget=10)], ids=["chain", "tree"])
def test_greedy_dflash_output_is_the_targets_own(target, draft, tree):
    prompt = chat(target, "Write a Python function that reverses a string.")
    reference = decode_plain(target, prompt, 32, eos_ids(target), GREEDY).tokens
    decoder = SpeculativeDecoder(target, get("dflash").proposer(draft, target), GREEDY, 5, tree=tree)
    assert decoder.generate(prompt, 32, eos_ids(target)).tokens == reference


def test_speculators_library_loads_our_dflash_export_and_computes_the_same_logits(tmp_path, target, conversation):
    """speculators 0.9.0's DFlashDraftModel reads our export (Qwen3 layers, fc, hidden_norm, the reduced head) and
    its own training forward, at the anchors ours scores, gives our block logits at every slot."""
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    from speculators_train.origin import resolve_origin

    draft = random_dflash(target, block_size=4, layers=2)
    recipe = load_recipe(
        make_recipe(tmp_path, [{"name": "s", "path": SHAREGPT, "max_records": 8}], draft={"family": "dflash"})
    )
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, draft, None, {"step": 1}, keep_last=1)
    out = export(recipe, checkpoint, "speculators", tmp_path / "spec", "float32").path
    written = json.loads((out / "config.json").read_text())
    assert written["speculators_model_type"] == "dflash" and written["architectures"] == ["DFlashDraftModel"]
    assert written["aux_hidden_state_layer_ids"] == target.aux_layer_ids and written["mask_token_id"] == MASK_ID
    assert (written["block_size"], written["sample_from_anchor"], written["sliding_window_non_causal"]) == (
        4,
        False,
        True,
    )
    assert written["transformer_layer_config"]["model_type"] == "qwen3"
    assert written["transformer_layer_config"]["num_hidden_layers"] == 2
    assert not list(out.glob("*.py"))  # no code file: engines read the config as data
    tensors = load_file(out / "model.safetensors")
    assert "embed_tokens.weight" not in tensors and tensors["lm_head.weight"].shape == (1024, 128)

    config = DFlashSpeculatorConfig.from_pretrained(out)
    config.speculators_config.verifier.name_or_path = resolve_origin(recipe.target)[0]  # offline: the local copy
    config.transformer_layer_config._attn_implementation = "eager"
    theirs = DFlashDraftModel.from_pretrained(out, config=config).eval()
    assert set(theirs.state_dict()) - set(tensors) == {
        "embed_tokens.weight",
        "verifier_norm.weight",
        "verifier_lm_head.weight",
    }
    with torch.no_grad():
        theirs.embed_tokens.weight.copy_(target.embed_tokens.weight)

    ids, aux, _ = conversation
    captured = []
    hook = theirs.lm_head.register_forward_hook(lambda _m, _a, out: captured.append(out.detach()))
    with torch.no_grad():
        anchors, _ = their_backbone(theirs, conversation, 4)
        loaded = load_draft_for(target, out).draft
        mine = loaded.training_forward(torch.tensor([ids]), aux, anchors[None])
    hook.remove()
    (their_logits,) = captured
    torch.testing.assert_close(their_logits.view(anchors.numel(), 4, -1)[:, 1:], mine[0], rtol=1e-4, atol=1e-4)


def their_backbone(theirs, conversation, block_size: int) -> tuple[torch.Tensor, tuple]:
    """(anchors, outputs) of a speculators block model's `_backbone_forward` over the conversation, its last 24
    tokens trained. Their anchors: every loss-mask position outside the last block, all drawn when max_anchors
    covers them."""
    ids, aux, final = conversation
    length = len(ids)
    loss_mask = torch.zeros(1, length, dtype=torch.long)
    loss_mask[0, length - 24 :] = 1
    anchors = torch.nonzero(loss_mask[0, : length - block_size]).flatten()
    outputs = theirs._backbone_forward(
        hidden_states=aux,
        input_ids=torch.tensor([ids]),
        loss_mask=loss_mask,
        verifier_last_hidden_states=final,
        document_ids=torch.zeros(1, length, dtype=torch.long),
        max_anchors=anchors.numel(),
    )
    return anchors, outputs


def test_dflash_refusals_name_what_is_wrong(tmp_path, target, draft):
    path = make_recipe(tmp_path, [{"name": "s", "path": SHAREGPT, "max_records": 8}], draft={"family": "dflash"})
    load_recipe(path, {"export.format": "gguf", "eval.engine": "llama.cpp"})  # llama.cpp serves it (gguf.py)
    for override, words in (
        ({"draft.loss": "forward_kl"}, "position_weight 'exp_decay'"),
        ({"draft.block_size": 1}, "block_size"),
    ):
        with pytest.raises(UserError, match=words):
            load_recipe(path, override)
    recipe = load_recipe(path)
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, draft, None, {"step": 1}, keep_last=1)
    out = export(recipe, checkpoint, "speculators", tmp_path / "spec", "float32").path
    config = json.loads((out / "config.json").read_text())
    for change, words in (
        ({"sample_from_anchor": True}, "sample_from_anchor"),
        ({"mask_token_id": None}, "mask_token_id is missing"),
        ({"mask_token_id": 49152}, "mask_token_id must be in 0..49151"),
        ({"block_size": 1}, "block_size must be in 2..64"),
    ):
        (out / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(UserError, match=words):
            load_draft_for(target, out)
    layers = {**config["transformer_layer_config"], "layer_types": ["sliding_attention", "full_attention"]}
    (out / "config.json").write_text(json.dumps({**config, "transformer_layer_config": layers}))
    with pytest.raises(UserError, match="layer_types"):
        load_draft_for(target, out)


def test_a_trained_dflash_draft_beats_its_start_verifies_exactly_and_exports(tmp_path, own_states):
    import shutil

    from speculators_train.training.trainer import Trainer
    from speculators_train.verify.run import verify

    dflash = {"family": "dflash", "draft_vocab_size": 1024, "block_size": 4, "num_layers": 1, "mask_token_id": 16}
    # batch 1: a DFlash draft needs steps, not samples, to stop drafting one token everywhere (docs/families.md)
    train = {"epochs": 6, "batch_size": 1, "learning_rate": 1e-3, "warmup_ratio": 0.0, "wandb": {"mode": "disabled"}}
    path = make_recipe(
        tmp_path,
        [{"name": "sharegpt", "path": SHAREGPT, "max_records": 20}],
        draft=dflash,
        data=OWN_REPLIES,
        training=train,
        eval={"num_speculative_tokens": 3, "num_prompts": 2, "max_new_tokens": 16},
    )
    shutil.copytree(own_states, tmp_path / "run" / "hidden_states")
    recipe = load_recipe(path)
    trainer = Trainer(recipe)
    before = trainer.validate()
    after = trainer.train()
    assert after["predicted_al_3"] > before["predicted_al_3"] + 0.05
    assert after["predicted_al_3"] == pytest.approx(1 + sum(after[f"full_acc_{d}"] for d in range(3)))
    assert after["acc_1"] > before["acc_1"]  # the second mask slot learns too
    _, records = verify(recipe, tmp_path / "run", tmp_path / "verify")
    assert all(r["greedy_identical_outputs"] == "2/2" for r in records)
    out = export(recipe, tmp_path / "run", "speculators", tmp_path / "out").path
    assert '"method": "dflash"' in (out / "README.md").read_text()


def test_online_distillation_adapts_a_dflash_draft_through_the_shared_step(tmp_path, target):
    from speculators_train.osd.distill import OnlineDistiller

    settings = {"family": "dflash", "block_size": 4, "num_layers": 1, "draft_vocab_size": 2048, "mask_token_id": 16}
    recipe, logs, _ = fresh_draft_on_logs(tmp_path, target, settings, target.aux_layer_ids)
    (first,) = OnlineDistiller(recipe, logs, target).run()
    assert first["promoted"], first["reason"]
    assert first["candidate_log_al"] > first["log_al"] >= 1.0
    written = json.loads((recipe.run_dir / "osd" / "current" / "speculators" / "config.json").read_text())
    assert written["speculators_model_type"] == "dflash"
