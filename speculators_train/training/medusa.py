"""Medusa-1 training: each head distils the target's distribution at its own future position.

Alignment (T tokens; y = stored pre-norm final states, l = loss mask; y_j gives the target's distribution of x_{j+1}):

    head h at position t reads norm(y_t) and predicts x_{t+2+h}:
        soft target  softmax(lm_head(norm(y_{t+1+h}))) over the draft vocab      (self-distillation)
        hard label   x_{t+2+h}
        mask         l_{t+2+h}, and the target's choice (soft) or the label (hard) inside the draft vocab

Head h's loss weight is decay**h. Accuracies compare with the target's greedy token, since that is what greedy
verification accepts: `full_i` counts positions where heads 0..i are all right (the chain a verifier accepts),
so the predicted acceptance length is 1 + sum_i full_acc_i as for EAGLE-3; `top1_i`/`top5_i` score each head alone,
and `rank{r}_i` counts how often head i's rank-r candidate is the target's token: the per-head accuracies Medusa
builds its candidate tree from (`verify.proposers.measured_tree`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from speculators_train.models.medusa import MedusaDraft
from speculators_train.models.vocab import draft_to_target
from speculators_train.training.ttt import TargetHead, global_counts

RANKS = 10  # candidate ranks scored per head: the widest tree a measured tree can grow


def medusa_loss(
    draft: MedusaDraft,
    batch: dict[str, torch.Tensor],
    head: TargetHead,
    decay: float,
    hard: bool,
    across_ranks: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted per-head loss and metric sums (the same keys as EAGLE-3's, plus `top1_i`, `top5_i`, `rank{r}_i` and
    `tokens_i`)."""
    ids, final, mask = batch["input_ids"], batch["hidden_state"], batch["loss_mask"]
    length = ids.shape[1]
    with torch.no_grad():
        final = final.to(head.lm_head.weight.dtype)
        target_logits = head(final).float()  # [B, T, V_target]
        greedy = target_logits.argmax(-1)
        draft_index = torch.cumsum(draft.t2d.to(torch.int64), 0) - 1  # target id -> draft id, where it has one
        greedy_draft = draft_index[greedy]
        in_vocab = draft.t2d[greedy]
        probs = torch.softmax(target_logits[..., draft_to_target(draft.d2t)], dim=-1)
        hidden = head.norm(final)
    logits = draft(hidden.to(draft.lm_heads[0].weight.dtype))  # [heads, B, T, V_draft]
    padded_mask = F.pad(mask, (0, 2), value=False)
    padded_ids = F.pad(ids, (0, 2))
    heads = draft.config.num_heads
    trained = [padded_mask[:, 2 + h : 2 + h + length - 1 - h] for h in range(heads)]
    if hard:
        labels = [padded_ids[:, 2 + h : 2 + h + length - 1 - h] for h in range(heads)]
        valid = [t & draft.t2d[lab] for t, lab in zip(trained, labels, strict=True)]
    else:
        valid = [t & in_vocab[:, 1 + h : length] for h, t in enumerate(trained)]
    counts = torch.stack([v.sum() for v in valid])
    denominators = global_counts(counts) if across_ranks else counts.clamp(min=1)
    total = torch.zeros((), device=ids.device)
    metrics: dict[str, torch.Tensor] = {}
    chain_ok = torch.ones_like(trained[0])
    chain_in = torch.ones_like(trained[0])
    for h in range(heads):
        n = length - 1 - h
        lg = logits[h][:, :n].float()
        if hard:
            ce = F.cross_entropy(lg.transpose(1, 2), draft_index[labels[h]].clamp(min=0), reduction="none")
        else:
            ce = -(probs[:, 1 + h : length] * torch.log_softmax(lg, dim=-1)).sum(-1)
        total = total + decay**h * (ce * valid[h]).sum() / denominators[h]
        want = greedy_draft[:, 1 + h : length]
        right = in_vocab[:, 1 + h : length]
        hits = (lg.topk(min(RANKS, lg.shape[-1]), dim=-1).indices == want[..., None]) & right[..., None]
        correct = hits[..., 0]
        prev = chain_ok[:, :n]
        chain_in = chain_in[:, :n] & trained[h]
        metrics[f"cond_n_{h}"] = (prev & chain_in).sum().float()
        chain_ok = prev & correct & trained[h]
        metrics[f"loss_{h}"] = (ce * valid[h]).sum().detach()
        metrics[f"n_{h}"] = counts[h].float()
        metrics[f"full_{h}"] = (chain_ok & chain_in).sum().float()
        metrics[f"chains_{h}"] = chain_in.sum().float()
        ranked = (hits & trained[h][..., None]).sum((0, 1)).float()
        metrics[f"top1_{h}"] = ranked[0]
        metrics[f"top5_{h}"] = ranked[:5].sum()
        for r in range(RANKS):
            metrics[f"rank{r}_{h}"] = ranked[r] if r < len(ranked) else torch.zeros((), device=ids.device)
        metrics[f"tokens_{h}"] = trained[h].sum().float()
    return total, metrics


class MedusaObjective(nn.Module):
    """Heads + frozen target head; the trainer calls `forward(batch) -> (loss, metric sums)` as for EAGLE-3."""

    def __init__(self, draft: MedusaDraft, head: TargetHead, decay: float, hard: bool) -> None:
        super().__init__()
        self.draft = draft
        self.head = head
        self.decay = decay
        self.hard = hard
        self.steps = draft.config.num_heads
        ranks = tuple(f"rank{r}" for r in range(RANKS))
        self.metric_names = ("loss", "n", "full", "chains", "cond_n", "top1", "top5", "tokens", *ranks)

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return medusa_loss(self.draft, batch, self.head, self.decay, self.hard, across_ranks=self.training)
