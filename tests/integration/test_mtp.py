"""The MTP head with the real SmolLM2 target: the proposer's cache, positions and fed-back outputs are the ones
training and vLLM's MTP proposer use."""

import pytest
import torch

from speculators_train.families import get
from speculators_train.head import load_head_weights
from speculators_train.proposal import Sampling
from speculators_train.recipe import TargetConfig
from speculators_train.verify.decoder import decode_plain
from tests.conftest import chat, start_of, tiny_config
from tests.integration.test_verify import GREEDY


@pytest.fixture(scope="module")
def head_and_conversation(target):
    """A random MTP head (its block far from zero, so a wrong position or input shows) and a prompt with the
    target's reply: (draft, ids, pre-norm final states [L, H])."""
    family = get("mtp")
    config, weights = load_head_weights(tiny_config())
    torch.manual_seed(0)
    draft = family.new_draft(family.settings(family="mtp"), start_of(config, weights, torch.ones(1), []))
    with torch.no_grad():
        for p in draft.parameters():
            if p.requires_grad and p.dim() > 1:
                p.normal_(0, 0.05)
    prompt = chat(target, "Explain what a hash table is in two sentences.")
    ids = prompt + decode_plain(target, prompt, 24, set(), GREEDY).tokens
    _, final = target.hidden_states(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
    return draft.to(target.device).eval(), ids, final[0]


def test_each_first_draft_is_trainings_step_zero_at_that_position(target, head_and_conversation):
    """Committing a conversation a few tokens at a time (the loop's `extend`), the head's first draft after each
    commit is training's step-0 argmax at the last committed position: the pair (h_p, x_{p+1}) at position p, the
    embedding zero at p = 0, the cache holding the earlier pairs."""
    draft, ids, final = head_and_conversation
    proposer = get("mtp").proposer(draft, target)
    with torch.no_grad():
        hidden = target.final_norm(final)[None]
        out = draft.step(hidden[:, :-1], torch.tensor([ids[1:]]), torch.arange(len(ids) - 1)[None])
        trained = draft.logits(out)[0].argmax(-1)
    proposer.reset()
    committed = 0
    for size in (5, 1, 3, 7, 2, 4):
        proposer.extend(ids[committed + 1 : committed + 1 + size], final[committed : committed + size])
        committed += size
        drafts, _ = proposer.propose_chain(1, GREEDY, None)
        assert drafts == [int(trained[committed - 1])], committed


def test_later_drafts_feed_the_heads_output_back_at_the_next_position(target, head_and_conversation):
    """Draft i > 0 reads the head's own pre-norm output at the position before and the token it drafted, at the
    next position, attending to the committed pairs (vLLM's MTP proposer): one causal pass over those inputs gives
    the distributions each sampled draft was drawn from. Feeding the post-norm output, the target's state or
    another position changes them; the drafted positions leave nothing behind for the next proposal."""
    draft, ids, final = head_and_conversation
    proposer = get("mtp").proposer(draft, target)
    proposer.extend(ids[1:20], final[:19])
    sampling = Sampling(temperature=1.0, draft_sampling="sample")
    drafts, q = proposer.propose_chain(3, sampling, torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = target.final_norm(final[:19])[None]
        tokens, positions, expected = list(ids[1:20]), list(range(19)), []
        for i in range(3):
            out = draft.step(hidden, torch.tensor([tokens]), torch.tensor([positions]))
            expected.append(torch.softmax(draft.logits(out[0, -1]).float(), dim=-1))
            hidden = torch.cat([hidden, out[:, -1:]], dim=1)
            tokens.append(drafts[i])
            positions.append(19 + i)
    torch.testing.assert_close(q, torch.stack(expected), rtol=1e-4, atol=1e-6)
    proposer.extend(ids[20:22], final[19:21])
    _, q = proposer.propose_chain(1, sampling, torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = draft.step(target.final_norm(final[:21])[None], torch.tensor([ids[1:22]]), torch.arange(21)[None])
    torch.testing.assert_close(q[0], torch.softmax(draft.logits(out[0, -1]).float(), dim=-1), rtol=1e-4, atol=1e-6)


def test_speculators_mtp_draft_model_loads_our_export_and_gives_our_logits_at_every_step(tmp_path):
    """speculators 0.9.0's MTPDraftModel reads our `speculators` export of a Qwen3 target's head (the layer, its four
    extra tensors, the normed output fed back) and its teacher-forced logits at every step are ours; our reader
    gives back the same head. A DeepSeek-style head (pre-norm output fed back) is refused for this layout."""
    import json

    from safetensors.torch import save_file
    from speculators.models.mtp import MTPDraftModel

    from tests.targets import BY_NAME, build

    folder = build(BY_NAME["qwen3"], tmp_path / "target")
    family, fmt = get("mtp"), get("mtp").formats["speculators"]
    config, weights = load_head_weights(TargetConfig(name_or_path=str(folder)))
    start = start_of(config, weights, torch.ones(1), [], str(folder))
    torch.manual_seed(0)
    assert fmt.unsupported(family.new_draft(family.settings(family="mtp"), start))
    draft = family.new_draft(family.settings(family="mtp", style="qwen3_next"), start).eval()
    with torch.no_grad():
        for p in draft.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    assert not fmt.unsupported(draft)
    files, tensors = fmt.write(draft, "float32", str(folder), config.architectures, 3)
    out = tmp_path / "export"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(files))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    back, _ = fmt.read(out, files, config.num_hidden_layers)
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in draft.state_dict().items())
    theirs = MTPDraftModel.from_pretrained(out).eval()
    ids = torch.randint(0, 1000, (1, 20), generator=torch.Generator().manual_seed(1))
    hidden = torch.randn(1, 20, config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        their_logits, _, _ = theirs(input_ids=ids, hidden_states=hidden)
        n, state = 20 - 3 - 1, hidden
        for k in range(3):
            step = draft.step(state[:, :n], ids[:, 1 + k : 1 + k + n], torch.arange(k, k + n)[None])
            torch.testing.assert_close(draft.logits(step), their_logits[k], rtol=1e-4, atol=1e-4)
            state = draft.carry(step)


def test_a_qwen3_next_style_head_is_written_in_the_mtp_layout_and_read_back_from_it(tmp_path):
    """The `mtp` format writes a `qwen3_next`-style head where Qwen3-Next and Qwen3.5 checkpoints keep theirs
    (`mtp.*`, the MoE block's experts one by one as vLLM's `Qwen3NextMTP` loads them) and reads it back exactly;
    the target-only tensors (`model.layers.{n}`) of DeepSeek's layout are not written. `verify --engine vllm`
    refuses a `deepseek`-style head on this target before exporting it: vLLM would run it as the other style."""
    import json

    from safetensors.torch import save_file

    from speculators_train.engines.vllm.verify import run_vllm
    from speculators_train.errors import UserError
    from speculators_train.families.base import LoadedDraft
    from speculators_train.recipe import load_recipe
    from tests.conftest import SHAREGPT, make_recipe
    from tests.targets import BY_NAME, build

    folder = build(BY_NAME["qwen3-next"], tmp_path / "target")
    family, fmt = get("mtp"), get("mtp").formats["mtp"]
    config, weights = load_head_weights(TargetConfig(name_or_path=str(folder)))
    start = start_of(config, weights, torch.ones(1), [], str(folder))
    torch.manual_seed(0)
    draft = family.new_draft(family.settings(family="mtp", style="qwen3_next"), start).eval()
    with torch.no_grad():
        for p in draft.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    files, tensors = fmt.write(draft, "float32", str(folder), config.architectures, 3)
    assert files["speculators_train"]["style"] == "qwen3_next"
    extras = {"mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight"}
    assert extras < set(tensors)
    assert {"mtp.layers.0.mlp.experts.0.gate_proj.weight", "mtp.layers.0.self_attn.q_proj.weight"} < set(tensors)
    assert not [name for name in tensors if name.startswith("model.layers.")]
    out = tmp_path / "export"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(files))
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    back, _ = fmt.read(out, files, config.num_hidden_layers)
    assert back.config.style == "qwen3_next"
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in draft.state_dict().items())
    second = {**tensors, "mtp.layers.1.input_layernorm.weight": tensors["mtp.norm.weight"].clone()}
    save_file(second, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"MTP layers past the first, which are not read here: mtp\.layers\.1\."):
        fmt.read(out, files, config.num_hidden_layers)
    recipe = make_recipe(
        tmp_path / "recipe",
        [{"name": "s", "path": SHAREGPT}],
        target={"name_or_path": str(folder)},
        eval={"engine": "vllm"},
    )
    other = family.new_draft(family.settings(family="mtp"), start)
    with pytest.raises(UserError, match=r"vLLM drafts MTP for Qwen3NextForCausalLM with Qwen3NextMTP, whose weight"):
        run_vllm(load_recipe(recipe), [], LoadedDraft(family, other, tmp_path, False), tmp_path / "verify")
