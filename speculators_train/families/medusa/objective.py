"""Medusa-1 training: each head distils the target's distribution at its own future position.

Alignment (T tokens; y = stored pre-norm final states, l = loss mask; y_j gives the target's distribution of x_{j+1}):

    head h at position t reads norm(y_t) and predicts x_{t+2+h}:
        soft target  softmax(lm_head(norm(y_{t+1+h}))) over the draft vocab      (self-distillation)
        hard label   x_{t+2+h}
        mask         l_{t+2+h}, and the target's choice (soft) or the label (hard) inside the draft vocab

Head h's loss weight is decay**h. Accuracies compare with the target's greedy token, since that is what greedy
verification accepts: `full_acc_h` counts positions where heads 0..h are all right (the chain a verifier accepts),
so the predicted acceptance length is 1 + sum_h full_acc_h as for any chain; `top1_acc_h`/`top5_acc_h` score each
head alone, and `rank{r}_acc_h` is how often head h's rank-r candidate is the target's token: the per-head
accuracies Medusa builds its candidate tree from (`proposer.measured_tree`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from speculators_train.chunks import chunk_rows, chunked
from speculators_train.families.divergence import Divergence, divergence
from speculators_train.families.medusa.model import MedusaDraft
from speculators_train.families.objective import ChainAccuracy, Objective, Sums, global_counts, key, ratio
from speculators_train.families.vocab import draft_to_target
from speculators_train.head import TargetHead

RANKS = 10  # candidate ranks scored per head: the widest tree a measured tree can grow


def medusa_loss(
    draft: MedusaDraft,
    batch: dict[str, torch.Tensor],
    head: TargetHead,
    decay: float,
    hard: bool,
    across_ranks: bool = False,
    kind: Divergence = "ce",
) -> tuple[torch.Tensor, Sums]:
    """Weighted per-head loss (soft: `kind` against the target's distribution; hard: cross-entropy on labels) and
    the metric sums: `loss_h`, the chain accuracies, `top1_acc_h`, `top5_acc_h`, `rank{r}_acc_h` and
    `vocab_coverage`."""
    ids, final, mask = batch["input_ids"], batch["hidden_state"], batch["loss_mask"]
    length = ids.shape[1]
    with torch.no_grad():
        final = final.to(head.lm_head.weight.dtype)
        greedy = head.greedy(final)  # [B, T]: the target's top-1 over its whole vocabulary
        draft_index = torch.cumsum(draft.t2d.to(torch.int64), 0) - 1  # target id -> draft id, where it has one
        greedy_draft = draft_index[greedy]
        in_vocab = draft.t2d[greedy]
        weight = head.lm_head.weight[draft_to_target(draft.d2t)]  # the target's rows of the draft vocabulary
        hidden = head.norm(final).to(draft.lm_heads[0].weight.dtype)
    heads = draft.config.num_heads
    trained, valid, labels = _head_positions(draft, ids, mask, in_vocab, draft_index, hard)
    counts = torch.stack([v.sum() for v in valid])
    denominators = global_counts(counts) if across_ranks else counts.clamp(min=1)
    total = torch.zeros((), device=ids.device)
    sums: Sums = {"vocab_coverage": ratio(counts[0], trained[0].sum())}
    chains = ChainAccuracy()
    rows = chunk_rows(ids.shape[0], draft.config.draft_vocab_size)
    for h in range(heads):
        n = length - 1 - h
        x = draft.head_states(h, hidden[:, :n])

        def piece(x, y, v, want, right, label, h=h):  # one chunk of head h's positions
            lg = draft.head_logits(h, x).float()
            if hard:
                ce = F.cross_entropy(lg.transpose(1, 2), label.clamp(min=0), reduction="none")
            else:
                with torch.no_grad():
                    probs = torch.softmax(head.on(y, weight), dim=-1)
                ce = divergence(probs, torch.log_softmax(lg, dim=-1), kind)
            hits = (lg.topk(min(RANKS, lg.shape[-1]), dim=-1).indices == want[..., None]) & right[..., None]
            return (ce * v).sum(), hits

        window = slice(1 + h, length)
        loss_sum, hits = chunked(
            piece, rows, x, final[:, window], valid[h], greedy_draft[:, window], in_vocab[:, window], labels[h]
        )
        total = total + decay**h * loss_sum / denominators[h]
        sums[key("loss", h)] = ratio(loss_sum, counts[h])
        sums.update(chains.step(h, hits[..., 0] & trained[h], trained[h]))
        sums.update(_rank_sums(h, hits, trained[h]))
    return total, sums


def _head_positions(
    draft: MedusaDraft,
    ids: torch.Tensor,
    mask: torch.Tensor,
    in_vocab: torch.Tensor,
    draft_index: torch.Tensor,
    hard: bool,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Per head h (which proposes the token h + 2 after a position): the positions it trains on, those it is scored
    at (the label, or the target's top-1 when soft, inside the draft vocabulary), and its labels' draft ids."""
    length = ids.shape[1]
    padded_mask, padded_ids = F.pad(mask, (0, 2), value=False), F.pad(ids, (0, 2))
    heads = range(draft.config.num_heads)
    trained = [padded_mask[:, 2 + h : 2 + h + length - 1 - h] for h in heads]
    if not hard:
        labels = [torch.zeros_like(t, dtype=torch.int64) for t in trained]  # unused
        return trained, [t & in_vocab[:, 1 + h : length] for h, t in enumerate(trained)], labels
    targets = [padded_ids[:, 2 + h : 2 + h + length - 1 - h] for h in heads]
    valid = [t & draft.t2d[lab] for t, lab in zip(trained, targets, strict=True)]
    return trained, valid, [draft_index[lab] for lab in targets]  # the label's draft id, where `valid`


def _rank_sums(h: int, hits: torch.Tensor, trained: torch.Tensor) -> Sums:
    """Head `h`'s top-1, top-5 and per-rank accuracies at its trained positions (`hits` [B, T, ranks]: the target's
    top-1 is the head's rank-r proposal)."""
    ranked = (hits & trained[..., None]).sum((0, 1)).float()
    tokens = trained.sum()
    out = {key("top1_acc", h): ratio(ranked[0], tokens), key("top5_acc", h): ratio(ranked[:5].sum(), tokens)}
    for r in range(RANKS):
        hit = ranked[r] if r < len(ranked) else torch.zeros((), device=hits.device)
        out[key(f"rank{r}_acc", h)] = ratio(hit, tokens)
    return out


class MedusaObjective(Objective):
    columns = ("loss", "full_acc", "cond_acc", "top1_acc", "top5_acc")
    metric_names = (*columns, *(f"rank{r}_acc" for r in range(RANKS)))

    def __init__(self, draft: MedusaDraft, head: TargetHead, decay: float, hard: bool, kind: Divergence = "ce") -> None:
        super().__init__(draft, head)
        self.steps = draft.config.num_heads
        self.decay, self.hard, self.kind = decay, hard, kind

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Sums]:
        return medusa_loss(self.draft, batch, self.head, self.decay, self.hard, self.training, self.kind)
