"""EAGLE-3 draft, TTT masks/positions, loss alignment, draft vocabulary, and the export configs as engines parse
them: pure-function tests."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from speculators_train.families import get
from speculators_train.families.eagle.align import align
from speculators_train.families.eagle.model import Eagle3Config, Eagle3Draft
from speculators_train.families.eagle.speculators import clean_layer_config, speculators_config
from speculators_train.families.eagle3.formats import load_sglang_eagle3, sglang_config, weight_name
from speculators_train.families.eagle3.objective import ttt_loss
from speculators_train.families.eagle3.proposer import Eagle3Proposer
from speculators_train.families.format_common import export_tensors
from speculators_train.families.objective import summarize
from speculators_train.families.vocab import build_vocab_mapping, draft_to_target
from speculators_train.head import TargetHead
from speculators_train.proposal import Sampling

H, V, DV, AUX = 32, 64, 16, 3


def tiny_draft(seed: int = 0, norm_before_residual: bool = False, **norms: bool) -> Eagle3Draft:
    torch.manual_seed(seed)
    target = LlamaConfig(
        hidden_size=H,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=V,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
    )
    cfg = Eagle3Config.for_target(target, [1, 2, 3], DV, norm_before_residual, **norms)
    draft = Eagle3Draft(cfg).double()
    for p in draft.parameters():
        torch.nn.init.normal_(p, std=0.3)
    d2t, t2d = build_vocab_mapping(torch.arange(V).flip(0), DV)  # keeps ids 0..15
    draft.d2t.copy_(d2t)
    draft.t2d.copy_(t2d)
    return draft


def reference_chain(draft: Eagle3Draft, tokens, aux, positions, j: int, steps: int) -> list[torch.Tensor]:
    """Chain j computed like inference, one token at a time with an explicit KV list: the context is
    step 0 at positions <= j; step s adds one entry (teacher-forced token j+s, previous output as hidden)."""
    layer, attn = draft.layers[0], draft.layers[0].self_attn
    hd = attn.head_dim

    def run(tok, hid, pos, keys, values):
        emb = draft.embed_tokens(tok)
        normed = layer.hidden_norm(hid)
        residual = normed if layer.norm_before_residual else hid
        x = torch.cat([layer.input_layernorm(emb), normed], -1)
        q = attn.q_proj(x).view(1, -1, 1, hd)  # [1, nh, 1, d]
        k = attn.k_proj(x).view(1, -1, 1, hd)  # [1, nkv, 1, d]
        v = attn.v_proj(x).view(1, -1, 1, hd)
        cos, sin = draft.rotary_emb(x, torch.tensor([[pos]]))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k = k.repeat_interleave(attn.num_key_value_groups, 1)
        v = v.repeat_interleave(attn.num_key_value_groups, 1)
        ks, vs = torch.cat([*keys, k], 2), torch.cat([*values, v], 2)
        w = torch.softmax((q @ ks.transpose(-1, -2)) / math.sqrt(hd), -1)
        out = attn.o_proj((w @ vs).transpose(1, 2).reshape(1, -1)) + residual
        out = out + layer.mlp(layer.post_attention_layernorm(out))
        return out, k, v, draft.lm_head(draft.norm(out))

    # EAGLE-3.1: an RMSNorm over the concatenated states before fc; the post-norm output fed back between steps.
    fused = aux[0]
    if draft.config.norm_before_fc:
        fused = fused * torch.rsqrt(fused.pow(2).mean(-1, keepdim=True) + 1e-6) * draft.input_norm.weight
    hidden0 = draft.fc(fused)
    keys, values = [], []
    for p in range(j + 1):  # step 0 over the context, causal
        out, k, v, logits = run(tokens[0, p : p + 1], hidden0[p : p + 1], int(positions[0, p]), keys, values)
        keys.append(k)
        values.append(v)
    results, hidden = [logits[0]], fed_back(draft, out)
    for s in range(1, steps):
        out, k, v, logits = run(tokens[0, j + s : j + s + 1], hidden, int(positions[0, j]) + s, keys, values)
        keys.append(k)
        values.append(v)
        results.append(logits[0])
        hidden = fed_back(draft, out)
    return results


def fed_back(draft: Eagle3Draft, out: torch.Tensor) -> torch.Tensor:
    return draft.norm(out) if draft.config.norm_output else out


@pytest.mark.parametrize(
    "settings",
    [{}, {"norm_before_residual": True}, {"norm_before_fc": True}, {"norm_before_fc": True, "norm_output": True}],
    ids=["eagle3", "norm_before_residual", "norm_before_fc", "eagle3.1"],
)
def test_ttt_unroll_equals_token_by_token_reference(settings):
    draft = tiny_draft(**settings)
    if draft.input_norm is not None:
        torch.nn.init.uniform_(draft.input_norm.weight, 0.5, 1.5)
    t, steps = 12, 4
    tokens = torch.randint(0, V, (1, t))
    aux = torch.randn(1, t, AUX * H, dtype=torch.float64)
    positions = torch.arange(1, t + 1)[None]
    logits = draft.ttt_forward(tokens, aux, positions, steps)
    for j in range(t - steps + 1):
        for i, ref in enumerate(reference_chain(draft, tokens, aux, positions, j, steps)):
            # LlamaRMSNorm rounds through float32 even in float64: 1e-6, far below a wrong mask or feedback (~0.1).
            torch.testing.assert_close(logits[i][0, j], ref, rtol=1e-6, atol=1e-6, msg=f"chain {j} step {i}")


def test_reference_catches_missing_rope_offset_and_future_leak():
    """The reference test must fail if RoPE offsets were dropped or later positions leaked in."""
    draft = tiny_draft()
    t, steps = 10, 3
    tokens, aux = torch.randint(0, V, (1, t)), torch.randn(1, t, AUX * H, dtype=torch.float64)
    positions = torch.arange(1, t + 1)[None]
    good = draft.ttt_forward(tokens, aux, positions, steps)
    ref = reference_chain(draft, tokens, aux, positions, 3, steps)
    no_offset = draft.ttt_forward.__func__  # run steps with a frozen position to emulate the bug
    draft_bug = tiny_draft()
    original_layer = draft_bug._layer

    def layer_without_offset(tok, hid, pos, past):
        return original_layer(tok, hid, positions, past)

    draft_bug._layer = layer_without_offset
    bad = no_offset(draft_bug, tokens, aux, positions, steps)
    assert not torch.allclose(bad[2][0, 3], ref[2])
    assert torch.allclose(good[2][0, 3], ref[2])
    # Future leak: changing a token after chain 3's reach must not change chain 3.
    tokens2 = tokens.clone()
    tokens2[0, 3 + steps :] = (tokens2[0, 3 + steps :] + 1) % V
    changed = draft.ttt_forward(tokens2, aux, positions, steps)
    for i in range(steps):
        torch.testing.assert_close(changed[i][0, 3], good[i][0, 3])


def test_vocab_mapping_round_trip_and_padding():
    freq = torch.zeros(100, dtype=torch.int64)
    freq[[7, 3, 50, 99]] = torch.tensor([5, 9, 1, 5])
    d2t, t2d = build_vocab_mapping(freq, 6)
    kept = draft_to_target(d2t)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert kept.tolist() == [0, 1, 3, 7, 50, 99], "seen ids kept, padded with unseen low ids, ascending"
    assert t2d.nonzero().flatten().tolist() == kept.tolist()
    assert (d2t == kept - torch.arange(6)).all()
    d2t, _ = build_vocab_mapping(freq, 3)
    assert draft_to_target(d2t).tolist() == [3, 7, 99], "ties broken towards the lower id"
    with pytest.raises(ValueError, match="draft_vocab_size 101"):
        build_vocab_mapping(freq, 101)


def head_for(draft: Eagle3Draft) -> TargetHead:
    torch.manual_seed(1)
    norm = torch.nn.Identity()
    return TargetHead(norm, torch.randn(V, H, dtype=torch.float64)).double()


def test_loss_mask_moves_with_the_predicted_token():
    draft = tiny_draft()
    t = 10
    final = torch.randn(1, t, H, dtype=torch.float64)
    head = head_for(draft)
    # Make every target top-1 fall in the draft vocab (ids < 16) so only the loss mask decides.
    with torch.no_grad():
        head.lm_head.weight[DV:] = 0
        final = final.abs()
        head.lm_head.weight[:DV] = head.lm_head.weight[:DV].abs()
    mask = torch.zeros(1, t, dtype=torch.bool)
    mask[0, 6] = True  # only x6 is an assistant token
    batch = {
        "input_ids": torch.randint(0, V, (1, t)),
        "aux_hidden_states": torch.randn(1, t, AUX * H).double(),
        "hidden_state": final,
        "loss_mask": mask,
    }
    a = align(batch, head, draft)
    # x6 is predicted at chain index j with j + 2 = 6, from target state y5 = final[:, 5].
    assert a.valid[0].nonzero().flatten().tolist() == [4]
    expected = torch.softmax(head(final[:, 5])[0, :DV], -1)
    torch.testing.assert_close(a.target_probs(head, a.final[:, 4])[0], expected.float())
    assert a.tokens[0, 4] == batch["input_ids"][0, 5] and a.positions[0, 4] == 5
    _, metrics = ttt_loss(draft, batch, head, steps=3, decay=0.8)
    # Step i predicts x6 from chain j = 4 - i: exactly one trained token at each step.
    assert [int(metrics[f"loss_{i}"][1]) for i in range(3)] == [1, 1, 1]
    # Accuracy counts whole chains: none predicts assistant tokens at two consecutive steps here.
    assert [int(metrics[f"full_acc_{i}"][1]) for i in range(3)] == [1, 0, 0]


def test_targets_outside_draft_vocab_are_masked():
    draft = tiny_draft()
    head = head_for(draft)
    with torch.no_grad():
        head.lm_head.weight[:DV] = 0  # top-1 always outside the kept ids
        head.lm_head.weight[DV:] = head.lm_head.weight[DV:].abs()
    batch = {
        "input_ids": torch.randint(0, V, (1, 8)),
        "aux_hidden_states": torch.randn(1, 8, AUX * H).double(),
        "hidden_state": torch.rand(1, 8, H).double(),
        "loss_mask": torch.ones(1, 8, dtype=torch.bool),
    }
    assert not align(batch, head, draft).valid.any()


def test_step_weights_decay_and_metrics_summary():
    draft = tiny_draft()
    head = head_for(draft)
    batch = {
        "input_ids": torch.randint(0, V, (2, 9)),
        "aux_hidden_states": torch.randn(2, 9, AUX * H).double(),
        "hidden_state": torch.randn(2, 9, H).double(),
        "loss_mask": torch.ones(2, 9, dtype=torch.bool),
    }
    loss, metrics = ttt_loss(draft, batch, head, steps=3, decay=0.5)
    expected = sum(0.5**i * metrics[f"loss_{i}"][0] / metrics[f"loss_{i}"][1] for i in range(3))
    torch.testing.assert_close(loss, expected)
    summary = summarize(metrics, 2)
    assert summary["predicted_al_2"] == pytest.approx(1 + summary["full_acc_0"] + summary["full_acc_1"])
    assert summary["full_acc_1"] <= summary["full_acc_0"]
    assert summary["vocab_coverage"] == pytest.approx(
        float(metrics["vocab_coverage"][0] / metrics["vocab_coverage"][1])
    )


def test_gradient_checkpointing_gives_the_same_loss_and_gradients():
    head = head_for(tiny_draft())
    batch = {
        "input_ids": torch.randint(0, V, (2, 9)),
        "aux_hidden_states": torch.randn(2, 9, AUX * H).double(),
        "hidden_state": torch.randn(2, 9, H).double(),
        "loss_mask": torch.ones(2, 9, dtype=torch.bool),
    }
    results = []
    for flag in (False, True):
        draft = tiny_draft(seed=3)
        draft.gradient_checkpointing = flag
        draft.train()
        loss, _ = ttt_loss(draft, batch, head, steps=3, decay=0.8)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and "fc.weight" in grads_a
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], msg=name)


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize(
    "rope", [{"rope_type": "default", "rope_theta": 123456.0}, LLAMA3_ROPE], ids=lambda r: r["rope_type"]
)
def test_speculators_export_writes_the_targets_rope_nested_and_flat(rope):
    """Newer vLLM reads `rope_parameters`; older vLLM reads flat `rope_theta`/`rope_scaling` and, without them,
    runs theta 10000 (a draft trained at another theta then attends at the wrong positions)."""
    target = LlamaConfig(hidden_size=H, intermediate_size=48, num_attention_heads=4, vocab_size=V, rope_parameters=rope)
    config = Eagle3Config.for_target(target, [1, 2, 3], DV, False)
    written = json.loads(json.dumps(speculators_config(config, "org/target", ["LlamaForCausalLM"], 3, "float32")))
    layer = written["transformer_layer_config"]
    assert layer["rope_parameters"]["rope_theta"] == rope["rope_theta"]
    assert layer.get("rope_theta", 10000.0) == rope["rope_theta"]  # the flat reading, with older vLLM's fallback
    if rope["rope_type"] == "default":
        assert "rope_scaling" not in layer
    else:
        assert {k: layer["rope_scaling"][k] for k in rope} == rope
    assert LlamaConfig(**clean_layer_config(layer)).rope_parameters == target.rope_parameters  # our reader agrees


def test_sglang_export_carries_ids_each_engine_reads_as_the_trained_ones(tmp_path):
    """SGLang captures `id + 1` for each id in `eagle_config`; vLLM and llama.cpp's converter read the top-level key
    as is. Both must land on the trained ids, and our reader follows SGLang's key."""
    draft = tiny_draft()
    draft.config.aux_layer_ids = [2, 5, 9]
    written = json.loads(json.dumps(sglang_config(draft.config, "float32")))
    sglang = [i + 1 for i in written["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    vllm = written["eagle_aux_hidden_state_layer_ids"]
    assert sglang == vllm == [2, 5, 9]

    save_file(export_tensors(draft, "float32", weight_name), tmp_path / "model.safetensors")
    written["eagle_aux_hidden_state_layer_ids"] = [7, 8, 9]  # a reader of the wrong key would now differ
    loaded, _ = load_sglang_eagle3(tmp_path, written, target_num_layers=12)
    assert loaded.config.aux_layer_ids == [2, 5, 9]


def test_chain_drafts_the_argmax_at_any_temperature_unless_asked_to_sample():
    """vLLM and SGLang draft the argmax at T > 0 too; sampled drafts must report the q they were drawn from."""
    draft = tiny_draft()
    proposer = Eagle3Proposer(draft, get("eagle3").states(draft.config))
    torch.manual_seed(1)
    proposer.extend(torch.randint(0, V, (6,)).tolist(), torch.randn(6, AUX * H).double())
    greedy, _ = proposer.propose_chain(4, Sampling(), None)
    assert proposer.propose_chain(4, Sampling(1.0, 0.9), torch.Generator()) == (greedy, None)
    _, q = proposer.propose_chain(4, Sampling(1.0, draft_sampling="sample"), torch.Generator().manual_seed(0))
    assert q.shape == (4, V) and torch.allclose(q.sum(-1), torch.ones(4, dtype=q.dtype))
