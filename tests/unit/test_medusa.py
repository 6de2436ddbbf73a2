"""Medusa on small synthetic tensors: the loss alignment (head h at position t is scored against the target's
choice for token t+2+h, its distribution at t+1+h, with the mask of that token), the per-rank accuracies, the
candidate trees built from them, and the export as vLLM's Medusa config parser and loader read it."""

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from speculators_train.families.medusa.formats import load_medusa, medusa_config, medusa_weights
from speculators_train.families.medusa.model import MedusaConfig, MedusaDraft
from speculators_train.families.medusa.objective import medusa_loss
from speculators_train.families.medusa.proposer import measured_tree
from speculators_train.families.objective import summarize
from speculators_train.head import TargetHead
from speculators_train.proposal import best_paths, tree_from_paths

V, H, T, HEADS = 16, 8, 12, 3


class Scripted(MedusaDraft):
    """Heads whose logits are given, so the test controls exactly what each head predicts where."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__(MedusaConfig(H, HEADS, 1, V, V))
        self.t2d.fill_(True)
        self.scripted = logits

    def head_states(self, h: int, hidden: torch.Tensor) -> torch.Tensor:
        return self.scripted[h][:, : hidden.shape[1]]  # the logits themselves, cut and chunked like states

    def head_logits(self, h: int, states: torch.Tensor) -> torch.Tensor:
        return states


def setup(seed: int = 0):
    torch.manual_seed(seed)
    head = TargetHead(LlamaRMSNorm(H), torch.randn(V, H) * 3)
    batch = {
        "input_ids": torch.randint(0, V, (1, T)),
        "hidden_state": torch.randn(1, T, H),
        "loss_mask": torch.ones(1, T, dtype=torch.bool),
    }
    greedy = head(batch["hidden_state"]).argmax(-1)[0]  # greedy[j] is the target's choice for token j+1
    return head, batch, greedy


def oracle(choice) -> torch.Tensor:
    """logits[h, 0, t] = a spike on choice(h, t) (None: flat)."""
    logits = torch.zeros(HEADS, 1, T, V)
    for h in range(HEADS):
        for t in range(T):
            token = choice(h, t)
            if token is not None:
                logits[h, 0, t, token] = 20.0
    return logits


def test_heads_right_about_token_t_plus_2_plus_h_score_full_accuracy():
    head, batch, greedy = setup()
    right = oracle(lambda h, t: int(greedy[t + 1 + h]) if t + 1 + h < T else None)
    _, sums = medusa_loss(Scripted(right), batch, head, 0.8, hard=False)
    out = summarize(sums, HEADS)
    assert [out[f"full_acc_{h}"] for h in range(HEADS)] == [1.0] * HEADS
    assert out[f"predicted_al_{HEADS}"] == 1.0 + HEADS
    assert [out[f"top1_acc_{h}"] for h in range(HEADS)] == [1.0] * HEADS

    early = oracle(
        lambda h, t: int(greedy[t + h]) if t + h < T else None
    )  # one token early: what the target's own head would say
    _, sums = medusa_loss(Scripted(early), batch, head, 0.8, hard=False)
    out = summarize(sums, HEADS)
    assert out["full_acc_0"] < 0.5


def test_the_mask_is_that_of_the_predicted_token_and_hard_labels_are_the_tokens_two_ahead():
    head, batch, _ = setup(1)
    batch["loss_mask"][0, :5] = False  # a prompt: tokens 0..4 are not trained
    _, sums = medusa_loss(Scripted(oracle(lambda h, t: None)), batch, head, 0.8, hard=False)
    # head h at t predicts token t+2+h, trained iff t+2+h >= 5 and it exists: t in [max(0, 3-h), T-3-h]
    assert [int(sums[f"top1_acc_{h}"][1]) for h in range(HEADS)] == [T - 2 - h - max(0, 3 - h) for h in range(HEADS)]

    labels = batch["input_ids"][0]
    by_label = oracle(lambda h, t: int(labels[t + 2 + h]) if t + 2 + h < T else None)
    hard_right, _ = medusa_loss(Scripted(by_label), batch, head, 0.8, hard=True)
    by_label_early = oracle(lambda h, t: int(labels[t + 1 + h]) if t + 1 + h < T else None)
    hard_wrong, _ = medusa_loss(Scripted(by_label_early), batch, head, 0.8, hard=True)
    assert hard_right < 1e-3 < hard_wrong


def test_rank_counts_place_each_heads_hit_at_the_rank_it_gave_the_target_token():
    head, batch, greedy = setup()
    logits = oracle(lambda h, t: int(greedy[t + 1 + h]) if t + 1 + h < T else None)
    decoy = min(set(range(V)) - set(greedy.tolist()))  # a token the target never picks here
    logits[:, :, 0::2, decoy] += 30.0  # at even positions a wrong token outranks the right one
    _, sums = medusa_loss(Scripted(logits), batch, head, 0.8, hard=False)
    out = summarize(sums, HEADS)
    for h in range(HEADS):
        scored = T - 2 - h  # positions t with a token t+2+h
        even = (scored + 1) // 2
        assert out[f"rank1_acc_{h}"] == pytest.approx(even / scored)
        assert out[f"rank0_acc_{h}"] == pytest.approx(1 - even / scored) == out[f"top1_acc_{h}"]
        assert sum(out[f"rank{r}_acc_{h}"] for r in range(5)) == pytest.approx(out[f"top5_acc_{h}"]) == 1.0


def test_best_paths_take_the_highest_sums_parents_first_within_the_budget():
    scores = [[-0.1, -1.0, -3.0], [-0.2, -2.0], [-0.3]]
    paths = best_paths(scores, 5)
    assert paths == [(0,), (0, 0), (0, 0, 0), (1,), (1, 0)]
    for i, path in enumerate(paths):
        assert len(path) == 1 or path[:-1] in paths[:i]
    every = best_paths(scores, 100)
    assert len(every) == 3 + 3 * 2 + 3 * 2 * 1  # all paths of the 3 x 2 x 1 candidate grid


def test_measured_tree_grows_where_heads_are_accurate_and_keeps_real_ranks():
    # Head 0 is right 60% at rank 0, 20% at rank 1; head 1's rank 1 beats its rank 0 (kept as rank 1, not 0).
    accuracy = [[0.6, 0.2, 0.05], [0.1, 0.3], [0.5]]
    paths = measured_tree(accuracy, 4)
    # products: (0,)=.6  (0,1)=.18  (1,)=.2  (0,1,0)=.09  (0,0)=.06  (1,1)=.06 ...
    assert paths == ((0,), (1,), (0, 1), (0, 1, 0))
    tree = tree_from_paths(list(paths), [[10, 11, 12], [20, 21], [30]])
    assert tree.tokens == [10, 11, 21, 30] and tree.parents == [-1, -1, 0, 2] and tree.depths == [1, 1, 2, 3]


def vllm_medusa_config(config: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """What vLLM's own `MedusaConfig.from_pretrained` makes of `config` written as a config.json (it renames
    top-level keys holding "num" and "heads"/"layers")."""
    from vllm.transformers_utils.configs.medusa import MedusaConfig as VllmMedusaConfig

    folder = tmp_path / "vllm-config"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return VllmMedusaConfig.from_pretrained(str(folder)).to_dict()


def vllm_medusa_parameters(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The parameters vLLM's `Medusa` model builds from its config, with their shapes; its `load_weights` keeps
    these names (after stripping `medusa_heads.`) plus `token_map`, and silently drops any other name."""
    h, heads, layers = config["hidden_size"], config["num_heads"], config["num_hidden_layers"]
    rows = config.get("truncated_vocab_size") or config["vocab_size"]
    params: dict[str, tuple[int, ...]] = {}
    for head in range(heads):
        for layer in range(layers):
            params[f"blocks.{head}.layers.{layer}.weight"] = (h, h)
            if config.get("medusa_fc_bias", False):
                params[f"blocks.{head}.layers.{layer}.bias"] = (h,)
        if not config.get("original_lm_head", False):
            params[f"lm_heads.{head}.weight"] = (rows, h)
    if config.get("original_lm_head", False):
        params["lm_head.weight"] = (rows, h)
    return params


def test_vllm_parses_our_medusa_export_to_the_trained_heads_and_blocks(tmp_path: Path):
    # Blocks per head (2) and the target's layer count (30) differ, so a key renamed onto the other shows.
    config = MedusaConfig(H, HEADS, 2, 12, V, target_num_layers=30)
    draft = MedusaDraft(config)
    kept = [0, 1, 2, 3, 5, 6, 7, 9, 10, 11, 12, 13]
    draft.d2t.copy_(torch.tensor(kept) - torch.arange(12))
    written = json.loads(json.dumps(medusa_config(config, "org/target", ["LlamaForCausalLM"], HEADS, "float32")))
    parsed = vllm_medusa_config(written, tmp_path)
    assert (parsed["num_heads"], parsed["num_hidden_layers"]) == (HEADS, 2)
    # Full-size heads (formats.py: vLLM 0.32 cannot load heads when truncated_vocab_size < vocab_size).
    assert (parsed["hidden_size"], parsed["vocab_size"], parsed["truncated_vocab_size"]) == (H, V, V)

    weights = medusa_weights(draft, "float32")
    expected = vllm_medusa_parameters(parsed)
    assert {name: tuple(t.shape) for name, t in weights.items() if name != "token_map"} == expected
    assert weights["token_map"].dtype == torch.int64 and weights["token_map"].tolist() == kept

    # Our reader gets the target's layer count back from where it is nested, and from the old top-level key.
    save_file(weights, tmp_path / "model.safetensors")
    assert load_medusa(tmp_path, written).config == config
    old = {k: v for k, v in written.items() if k != "speculators_train"} | {"target_num_layers": 30}
    assert load_medusa(tmp_path, old).config.target_num_layers == 30
