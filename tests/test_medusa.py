"""Medusa-1 loss alignment on small synthetic tensors: head h at position t must be scored against the target's
choice for token t+2+h (its distribution at t+1+h), with the mask of that token."""

import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from speculators_train.models.medusa import MedusaConfig, MedusaDraft
from speculators_train.training.medusa import medusa_loss
from speculators_train.training.ttt import TargetHead, summarize

V, H, T, HEADS = 16, 8, 12, 3


class Scripted(MedusaDraft):
    """Heads whose logits are given, so the test controls exactly what each head predicts where."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__(MedusaConfig(H, HEADS, 1, V, V))
        self.t2d.fill_(True)
        self.scripted = logits

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.scripted


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
    out = summarize({k: float(v) for k, v in sums.items()}, HEADS)
    assert [out[f"full_acc_{h}"] for h in range(HEADS)] == [1.0] * HEADS
    assert out[f"predicted_al_{HEADS}"] == 1.0 + HEADS
    assert [out[f"top1_acc_{h}"] for h in range(HEADS)] == [1.0] * HEADS

    early = oracle(
        lambda h, t: int(greedy[t + h]) if t + h < T else None
    )  # one token early: what the target's own head would say
    _, sums = medusa_loss(Scripted(early), batch, head, 0.8, hard=False)
    out = summarize({k: float(v) for k, v in sums.items()}, HEADS)
    assert out["full_acc_0"] < 0.5


def test_the_mask_is_that_of_the_predicted_token_and_hard_labels_are_the_tokens_two_ahead():
    head, batch, _ = setup(1)
    batch["loss_mask"][0, :5] = False  # a prompt: tokens 0..4 are not trained
    _, sums = medusa_loss(Scripted(oracle(lambda h, t: None)), batch, head, 0.8, hard=False)
    # head h at t predicts token t+2+h, trained iff t+2+h >= 5 and it exists: t in [max(0, 3-h), T-3-h]
    assert [int(sums[f"tokens_{h}"]) for h in range(HEADS)] == [T - 2 - h - max(0, 3 - h) for h in range(HEADS)]

    labels = batch["input_ids"][0]
    by_label = oracle(lambda h, t: int(labels[t + 2 + h]) if t + 2 + h < T else None)
    hard_right, _ = medusa_loss(Scripted(by_label), batch, head, 0.8, hard=True)
    by_label_early = oracle(lambda h, t: int(labels[t + 1 + h]) if t + 1 + h < T else None)
    hard_wrong, _ = medusa_loss(Scripted(by_label_early), batch, head, 0.8, hard=True)
    assert hard_right < 1e-3 < hard_wrong
