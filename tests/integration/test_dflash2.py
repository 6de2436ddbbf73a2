"""DFlash2 with the real SmolLM2 target: the export loaded by the `speculators` library's own DFlash2DraftModel gives
our logits and selector scores at every slot, and the proposer walks each slot's candidates from the token it chose
before."""

import json

import torch

from speculators_train.export.run import export
from speculators_train.families import get
from speculators_train.families.dflash2.model import DFlash2Draft
from speculators_train.recipe import load_recipe
from speculators_train.training.checkpoint import save_checkpoint
from speculators_train.verify.decoder import SpeculativeDecoder, decode_plain
from speculators_train.verify.run import eos_ids, load_draft_for
from tests.conftest import SHAREGPT, chat, make_recipe
from tests.integration import test_dflash
from tests.integration.test_dflash import MASK_ID, their_backbone
from tests.integration.test_verify import GREEDY


def random_dflash2(target, block_size: int = 4) -> DFlash2Draft:
    """The real DFlash2 architecture for SmolLM2 with random weights: convolutions and selector far from their
    identity start, so a tap or a codebook in the wrong place shows."""
    torch.manual_seed(0)
    settings = get("dflash2").settings(
        family="dflash2", num_layers=2, block_size=block_size, mask_token_id=MASK_ID, selector_rank=16, selector_top_k=8
    )
    config = get("dflash2").draft_config(settings, target.config, target.aux_layer_ids, target.vocab_size)
    draft = DFlash2Draft(config)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
            elif "conv" in name or "codebook" in name:
                p.normal_(0, 0.5)
        draft.embed_tokens.weight.copy_(target.embed_tokens.weight)
        draft.lm_head.weight.copy_(target.lm_head.weight)  # the whole vocabulary: the target's head, as engines run
    return draft.to(target.device).eval()


conversation = test_dflash.conversation  # the prompt and reply DFlash's tests use, per module


def test_speculators_library_loads_our_dflash2_export_and_computes_the_same_scores(tmp_path, target, conversation):
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig

    from speculators_train.origin import resolve_origin

    draft = random_dflash2(target)
    recipe = load_recipe(
        make_recipe(tmp_path, [{"name": "s", "path": SHAREGPT, "max_records": 8}], draft={"family": "dflash2"})
    )
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, draft, None, {"step": 1}, keep_last=1)
    out = export(recipe, checkpoint, "speculators", tmp_path / "spec", "float32").path
    written = json.loads((out / "config.json").read_text())
    assert written["speculators_model_type"] == "dflash2" and written["architectures"] == ["DFlash2DraftModel"]
    assert (written["selector_rank"], written["selector_top_k"], written["conv_kernel_size"]) == (16, 8, 2)

    config = DFlash2SpeculatorConfig.from_pretrained(out)
    config.speculators_config.verifier.name_or_path = resolve_origin(recipe.target)[0]
    config.transformer_layer_config._attn_implementation = "eager"
    theirs = DFlash2DraftModel.from_pretrained(out, config=config).eval()
    with torch.no_grad():
        theirs.embed_tokens.weight.copy_(target.embed_tokens.weight)

    ids, aux, _ = conversation
    with torch.no_grad():
        anchors, (hidden, logits, _, _, indices) = their_backbone(theirs, conversation, 4)
        previous = theirs._predecessor_ids(torch.tensor([ids]), indices)
        candidates = logits.topk(8, dim=-1).indices
        their_scores = theirs.candidate_selector.score_candidates(logits, hidden, previous.reshape(1, -1), candidates)

        loaded = load_draft_for(target, out).draft
        normed = loaded.training_forward(torch.tensor([ids]), aux, anchors[None], logits=False)[0]
        mine = loaded.lm_head(normed)
        before = torch.tensor(ids)[anchors[:, None] + torch.arange(3)]
        mine_scores = loaded.candidate_selector.scores(mine, normed, before, mine.topk(8, dim=-1).indices)
    n = anchors.numel()
    torch.testing.assert_close(logits.view(n, 4, -1)[:, 1:], mine, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(their_scores.view(n, 4, -1)[:, 1:], mine_scores, rtol=1e-4, atol=1e-4)


def test_greedy_dflash2_output_is_the_targets_own_and_the_walk_reads_its_choice(target, conversation):
    draft = random_dflash2(target)
    ids, aux, _ = conversation
    proposer = get("dflash2").proposer(draft, target)
    proposer.reset(ids[0])
    proposer.extend(ids[1:30], aux[0, :29])
    drafts, _ = proposer.propose_chain(3, GREEDY, None)
    normed = proposer.outputs(3, logits=False)
    previous = torch.tensor([ids[29], *drafts[:-1]])
    with torch.inference_mode():
        logits = draft.lm_head(normed)
        candidates = logits.topk(8, dim=-1).indices
        walked = draft.candidate_selector.scores(logits, normed, previous, candidates).argmax(-1)
    assert candidates.gather(-1, walked[:, None])[:, 0].tolist() == drafts
    prompt = chat(target, "Write a Python function that reverses a string.")
    reference = decode_plain(target, prompt, 24, eos_ids(target), GREEDY).tokens
    decoder = SpeculativeDecoder(target, get("dflash2").proposer(draft, target), GREEDY, 3)
    assert decoder.generate(prompt, 24, eos_ids(target)).tokens == reference


def test_the_selector_trains_on_speculators_candidates_with_the_target_injected_where_missing(target):
    """Each slot's training candidates and label are speculators' own (`selector_training_candidates`): the unary
    top-k, the target put in the last place where it is missing, the label its rank. A wrong rank or an injection
    in the wrong place trains the selector on the wrong choice while every loss still falls."""
    from speculators.models.dflash2.metrics import selector_training_candidates

    draft = random_dflash2(target)
    top_k, vocab = draft.candidate_selector.top_k, draft.config.target_vocab_size
    torch.manual_seed(1)
    logits, normed = torch.randn(64, vocab), torch.randn(64, draft.config.qwen3.hidden_size)
    previous = torch.randint(0, vocab, (64,))
    targets = torch.randint(0, vocab, (64,))
    targets[::2] = logits[::2].topk(top_k).indices[:, 3]  # half inside the top-k, at rank 3
    with torch.no_grad():
        scores, rank = draft.selector_logits(normed, previous, logits, targets)
        candidates, positions, present = selector_training_candidates(logits.topk(top_k).indices, targets)
        theirs = draft.candidate_selector.scores(logits, normed, previous, candidates)
    assert present[::2].all() and not present[1::2].any()
    assert torch.equal(rank, positions) and (rank[::2] == 3).all() and (rank[1::2] == top_k - 1).all()
    assert torch.equal(scores, theirs)
