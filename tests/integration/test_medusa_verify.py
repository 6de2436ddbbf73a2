"""Medusa heads in the verify loop and in export, with the session target on real prompts: greedy output is
the target's own in chain and both tree modes, the heads read the state of the last accepted position, sampled
proposals come from the distributions they report, and an export reloads (ours and vLLM's naming) to the same
proposals."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from speculators_train.errors import UserError
from speculators_train.export.run import export
from speculators_train.families import get
from speculators_train.families.medusa.model import MedusaDraft
from speculators_train.families.medusa.proposer import measured_tree
from speculators_train.families.vocab import build_vocab_mapping, draft_to_target
from speculators_train.proposal import Sampling, TreeSpec
from speculators_train.recipe import load_recipe
from speculators_train.target import StateSpec
from speculators_train.training.checkpoint import save_checkpoint
from speculators_train.verify.decoder import SpeculativeDecoder
from speculators_train.verify.run import eos_ids, load_draft_for
from tests.conftest import SHAREGPT, make_recipe
from tests.integration.test_verify import GREEDY, NoisyOracle
from tests.unit.test_sampling_rules import tv, tv_threshold

HEADS = 3


@pytest.fixture(scope="module")
def heads(target):
    """Real Medusa heads for the session target: lm_heads from the target's rows of 2048 scattered ids plus noise,
    random blocks, so every weight changes the proposals."""
    torch.manual_seed(0)
    freq = torch.zeros(target.vocab_size)
    freq[torch.randperm(target.vocab_size)[:2048]] = 1
    freq[:256] = 2  # the most common ids, so some drafts are accepted
    d2t, t2d = build_vocab_mapping(freq, 2048)
    rows = target.lm_head.weight.detach()[draft_to_target(d2t)]
    draft = MedusaDraft.for_target(target.config, rows, d2t, t2d, HEADS, 1)
    with torch.no_grad():
        for block in draft.blocks:
            block.layers[0].weight.normal_(0, 0.02)
            block.layers[0].bias.normal_(0, 0.02)
        for lm_head in draft.lm_heads:
            lm_head.weight.add_(torch.randn_like(lm_head.weight) * 0.01)
    return draft.eval()


def full_final_states(target, ids: list[int]) -> torch.Tensor:
    _, final = target.hidden_states(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
    return final[0]


TREES = {
    "chain": None,
    "dynamic": TreeSpec(top_k=3, depth=HEADS, budget=10),
    "measured": TreeSpec(paths=measured_tree([[0.5, 0.2, 0.1], [0.3, 0.1], [0.2, 0.05]], 8)),
}


@pytest.mark.parametrize("shape", list(TREES))
def test_greedy_medusa_output_is_the_targets_own(target, prompts, references, heads, shape):
    tree = TREES[shape]
    accepted = []
    for prompt, reference in zip(prompts, references, strict=True):
        proposer = get("medusa").proposer(heads, target)
        result = SpeculativeDecoder(target, proposer, GREEDY, HEADS, tree).generate(prompt, 40, eos_ids(target))
        assert result.tokens == reference
        accepted += result.accepted
    assert len(accepted) < 2 * 40, "no draft was ever accepted: the heads test nothing"


class RecordingOracle(NoisyOracle):
    """Reads the target's final states as Medusa heads do and records, per committed position, the row it was
    given; proposes a noisy oracle so acceptance varies from step to step."""

    states = StateSpec(final=True)

    def __init__(self, reference: list[int]) -> None:
        super().__init__(reference)
        self.rows: dict[int, torch.Tensor] = {}

    def extend(self, tokens, states):
        for i, row in enumerate(states):
            self.rows[self.length - 1 + i] = row.clone()  # row i belongs to the position before tokens[i]
        super().extend(tokens, states)


@pytest.mark.parametrize("tree", [None, TreeSpec(top_k=2, depth=4, budget=8)], ids=["chain", "tree"])
def test_heads_get_the_final_state_of_every_accepted_position(target, prompts, references, tree):
    """After partial acceptance (and a tree's cache compaction) the state handed over for each committed position
    must be the target's own at that position; a Medusa proposer drafts from the last of them, whose lm_head
    token is the pending one, so head h proposes the token h+1 after it, as trained."""
    prompt, reference = prompts[0], references[0]
    proposer = RecordingOracle(prompt + reference)
    result = SpeculativeDecoder(target, proposer, GREEDY, 4, tree).generate(prompt, 30, eos_ids(target))
    assert set(result.accepted) - {0, 4}, "no partial acceptance"
    final = full_final_states(target, prompt + result.tokens)
    assert sorted(proposer.rows) == list(range(len(proposer.rows))) and len(proposer.rows) > len(prompt) + 20
    for position, row in proposer.rows.items():
        torch.testing.assert_close(row, final[position], rtol=1e-3, atol=1e-3)  # cached vs one-pass rounding


def test_medusa_proposer_drafts_from_the_last_state_after_the_final_norm(target, prompts, heads):
    ids = prompts[1]
    final = full_final_states(target, ids)
    proposer = get("medusa").proposer(heads, target)
    proposer.extend(ids[1:], final[:-1])
    with torch.no_grad():
        expected = heads(target.final_norm(final[-2]))  # the state at the position before the pending token
    torch.testing.assert_close(proposer.logits, expected)
    chain, q = proposer.propose_chain(HEADS, GREEDY, None)
    assert q is None and chain == draft_to_target(heads.d2t)[expected.argmax(-1)].tolist()
    with pytest.raises(ValueError, match="4 draft tokens asked of 3 Medusa heads"):
        proposer.propose_chain(HEADS + 1, GREEDY, None)


def test_sampled_medusa_proposals_come_from_the_distributions_they_report(target, prompts, heads):
    """Lossless rejection needs q to be exactly what each draft was drawn from: each head's softmax(logits / T),
    zero outside the draft vocabulary. 3000 draws of the first two heads are within 4x sampling noise of q. Drafting
    the argmax instead (the default, as engines do) reports no q: each draft is a point mass."""
    ids = prompts[0]
    proposer = get("medusa").proposer(heads, target)
    proposer.extend(ids[1:], full_final_states(target, ids)[:-1])
    g = torch.Generator().manual_seed(0)
    assert proposer.propose_chain(2, Sampling(0.8), g) == (proposer.propose_chain(2, GREEDY, None)[0], None)
    sampling = Sampling(0.8, draft_sampling="sample")
    draws, q = [], None
    for _ in range(3000):
        tokens, q = proposer.propose_chain(2, sampling, g)
        draws.append(tokens)
    ids_of = draft_to_target(heads.d2t)
    for h in range(2):
        expected = torch.zeros(target.vocab_size)
        expected[ids_of] = torch.softmax(proposer.logits[h] / 0.8, dim=-1)
        torch.testing.assert_close(q[h], expected)
        samples = [d[h] for d in draws]
        assert tv(samples, expected) < tv_threshold(expected, len(samples))


@pytest.fixture
def exported(tmp_path, heads):
    recipe = load_recipe(
        make_recipe(
            tmp_path,
            [{"name": "sharegpt", "path": SHAREGPT, "max_records": 8}],
            eval={"num_speculative_tokens": 5},
        )
    )
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, heads, None, {"step": 1}, keep_last=1)
    return recipe, checkpoint, export(recipe, checkpoint, "speculators", tmp_path / "out", "float32")


def test_medusa_export_is_the_vllm_medusa_format_and_reloads_to_the_same_proposals(
    target,
    prompts,
    heads,
    exported,
):
    recipe, checkpoint, result = exported
    config = json.loads((result.path / "config.json").read_text())
    # What vLLM's Medusa model reads, and the speculators-style fields.
    assert config["architectures"] == ["MedusaModel"] and config["model_type"] == "medusa"
    assert (config["hidden_size"], config["vocab_size"], config["num_heads"], config["num_hidden_layers"]) == (
        128,
        49152,
        HEADS,
        1,
    )
    # Full-size heads: vLLM 0.32 cannot load heads with truncated_vocab_size < vocab_size (tests/test_vllm.py).
    assert config["truncated_vocab_size"] == 49152 and config["medusa_fc_bias"] is True
    assert config["speculators_model_type"] == "medusa"
    spec = config["speculators_config"]
    assert spec["algorithm"] == "medusa" and spec["verifier"]["name_or_path"] == target.name_or_path
    assert spec["proposal_methods"][0]["speculative_tokens"] == HEADS  # K=5 asked, one token per head
    assert '"method": "medusa"' in result.commands[0] and '"num_speculative_tokens": 3' in result.commands[0]
    weights = load_file(result.path / "model.safetensors")
    # vLLM's load_weights keeps only its parameter names and token_map; anything else would be dropped silently.
    params = {f"blocks.{h}.layers.0.{p}" for h in range(HEADS) for p in ("weight", "bias")}
    params |= {f"lm_heads.{h}.weight" for h in range(HEADS)}
    assert set(weights) == params | {"token_map"}
    assert weights["lm_heads.0.weight"].shape == (49152, 128)  # = truncated_vocab_size rows: vLLM does not slice
    assert weights["token_map"].dtype == torch.int64
    assert weights["token_map"].tolist() == draft_to_target(heads.d2t).tolist()
    assert f"# Medusa heads for {target.name_or_path}" in (result.path / "README.md").read_text()

    loaded = load_draft_for(target, result.path)
    imported = loaded.draft
    assert loaded.path == result.path and isinstance(imported, MedusaDraft) and loaded.family.name == "medusa"
    runs = []
    for draft in (heads, imported):
        proposer = get("medusa").proposer(draft, target)
        runs.append(SpeculativeDecoder(target, proposer, GREEDY, HEADS).generate(prompts[0], 30, eos_ids(target)))
    assert runs[0].tokens == runs[1].tokens and runs[0].accepted == runs[1].accepted

    with pytest.raises(UserError, match=r"a medusa draft; its export formats are \['speculators'\]"):
        export(recipe, checkpoint, "sglang", result.path.parent / "sglang", "float32")


def test_a_vllm_medusa_directory_made_elsewhere_loads(tmp_path, target, prompts, heads):
    """vLLM's other spellings: a `medusa_heads.` prefix, one shared lm_head (`original_lm_head`), bias-free blocks
    and the full vocabulary without token_map."""
    lm_head = target.lm_head.weight.detach()
    weights = {f"medusa_heads.blocks.{h}.layers.0.weight": heads.blocks[h].layers[0].weight for h in range(HEADS)}
    weights["medusa_heads.lm_heads.0.weight"] = lm_head
    save_file({k: v.contiguous() for k, v in weights.items()}, tmp_path / "model.safetensors")
    config = {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": 128, "vocab_size": 49152}
    config.update(num_heads=HEADS, num_hidden_layers=1, truncated_vocab_size=49152, original_lm_head=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    imported = load_draft_for(target, tmp_path).draft
    hidden = torch.randn(128)
    with torch.no_grad():
        block = heads.blocks[1].layers[0]
        expected = lm_head @ (hidden + torch.nn.functional.silu(block.weight @ hidden))
        torch.testing.assert_close(imported(hidden)[1], expected, rtol=1e-4, atol=1e-3)
    (tmp_path / "config.json").write_text(json.dumps({**config, "truncated_vocab_size": 1000}))
    with pytest.raises(UserError, match="truncated_vocab_size 1000 < vocab_size 49152 but no token_map"):
        load_draft_for(target, tmp_path)
