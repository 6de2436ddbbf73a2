"""DFlash's objective: blocks anchored at assistant tokens, every block position scored from one forward.

Alignment (T tokens from the generator; g = aux states, y = pre-norm final states, l = loss mask):

    a block anchored at index a (x_a an assistant token, as the bonus token at inference always is) sees the
    states g_0 .. g_{a-1}; its slot i (1 <= i < B) proposes x_{a+i}, scored against the target's distribution from
    y_{a+i-1} with the mask l_{a+i}, and not scored where that target's top-1 is outside the draft vocabulary.

Training draws at most `max_anchors` anchors per sample uniformly (speculators' `select_anchors`); validation scores
every anchor. The loss is sum_i w_i * divergence_i over scored elements, divided by their count (speculators'), with
w_i = exp(-(i - 1) / gamma) (the paper's decay) or D-PACE's: w_i = sum_{k >= i} prod_{m <= k} ((1 - alpha) c_m +
alpha) over the block's scored positions, c_m = exp(-ce_m) the draft's confidence, not differentiated.

Metrics per block position (step d is slot d + 1): `loss_d`, `acc_d` and the chain accuracies of
`families.objective` over blocks (a block is right at step d when slots 1..d+1 all are), so AL(k) = 1 + sum_{d<k}
full_acc_d predicts the loop's acceptance at k = B - 1 draft tokens.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F

from speculators_train.chunks import chunk_rows, chunked
from speculators_train.families.block.model import DFlashDraft
from speculators_train.families.divergence import Divergence, divergence
from speculators_train.families.objective import ChainAccuracy, Objective, Sums, global_counts, key, ratio
from speculators_train.families.vocab import draft_to_target
from speculators_train.head import TargetHead


def sample_anchors(candidates: torch.Tensor, limit: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchors [B, n], present [B, n]): per row, at most `limit` (None: all) of the indices where `candidates`
    [B, T] is true, drawn uniformly without replacement and sorted; rows with fewer are padded (not present)."""
    rows = []
    for row in candidates.detach().cpu():
        pool = torch.nonzero(row).flatten()
        if limit is not None and len(pool) > limit:
            pool = pool[torch.randperm(len(pool))[:limit]].sort().values
        rows.append(pool)
    width = max(1, max(len(r) for r in rows))
    anchors = torch.zeros(len(rows), width, dtype=torch.long)
    present = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, pool in enumerate(rows):
        anchors[b, : len(pool)], present[b, : len(pool)] = pool, True
    return anchors.to(candidates.device), present.to(candidates.device)


def dpace_weights(confidence: torch.Tensor, scored: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE position weights [..., P] from per-position confidence and scored flags [..., P] (positions last)."""
    smooth = torch.where(scored, (1 - alpha) * confidence + alpha, torch.ones_like(confidence))
    reach = torch.cumprod(smooth, dim=-1) * scored
    return reach.flip(-1).cumsum(-1).flip(-1) * scored


class Scoring(NamedTuple):
    """What scoring a chunk of blocks reads besides the chunk: the target's states at trained positions (`picked`)
    and its head's rows of the draft vocabulary (`weight`)."""

    draft: DFlashDraft
    head: TargetHead
    picked: torch.Tensor
    weight: torch.Tensor
    kind: Divergence
    weighting: tuple[str, float, float]
    positions: int


def score_blocks(
    s: Scoring, h: torch.Tensor, slots: torch.Tensor, scored: torch.Tensor, before: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """One chunk of blocks [B, c, P]: the weighted loss sum, the confidence BCE sum and absolute error sum, the
    selector's weighted cross-entropy sum, each slot's divergence and whether it is right."""
    style, gamma, alpha = s.weighting
    lg = s.draft.slot_logits(h, before).float()
    with torch.no_grad():
        target = torch.softmax(s.head.on(s.picked[slots], s.weight), dim=-1)
    log_q = torch.log_softmax(lg, dim=-1)
    div = divergence(target, log_q, s.kind)
    decay = torch.exp(-torch.arange(s.positions, device=div.device, dtype=div.dtype) / gamma).expand_as(div)
    weights = dpace_weights(torch.exp(-div.detach()), scored, alpha) if style == "dpace" else decay
    bce = error = torch.zeros((), device=div.device)
    confidence = s.draft.confidence_logits(h, before)
    if confidence is not None:
        accept = torch.minimum(target, log_q.detach().exp()).sum(-1)  # 1 - TV: the slot's acceptance
        losses = F.binary_cross_entropy_with_logits(confidence.float(), accept, reduction="none")
        bce = (decay * losses * scored).sum()
        error = ((torch.sigmoid(confidence.detach().float()) - accept).abs() * scored).sum()
    selection = torch.zeros((), device=div.device)
    selected = s.draft.selector_logits(h, before, lg, target.argmax(-1))
    if selected is not None:  # speculators' selector loss: k-way CE at the slot's position weight
        candidate_scores, rank = selected
        ce = F.cross_entropy(candidate_scores.flatten(0, -2).float(), rank.flatten(), reduction="none")
        selection = (weights * ce.view_as(rank) * scored).sum()
    right = lg.argmax(-1) == target.argmax(-1)
    return (weights * div * scored).sum(), bce, error, selection, div.detach(), right


def block_loss(
    draft: DFlashDraft,
    batch: dict[str, torch.Tensor],
    head: TargetHead,
    positions: int,
    weighting: tuple[str, float, float],
    max_anchors: int,
    kind: Divergence,
    training: bool,
    auxiliary: tuple[float, float] = (0.0, 0.0),
) -> tuple[torch.Tensor, Sums]:
    """The loss over the first `positions` proposing slots of each block, and the metric sums. `weighting`:
    (position_weight, gamma, dpace_alpha); `auxiliary`: (confidence_weight, selector_weight). A draft that predicts
    its acceptance (`confidence_logits`) adds confidence_weight times its BCE against the slot's analytical
    acceptance 1 - TV(target, draft), not differentiated, with the exp-decay weights (speculators' DSpark loss); one
    with a candidate selector (`selector_logits`) adds selector_weight times the selector's cross-entropy at the
    position weights (speculators' DFlash2 loss)."""
    ids, aux, final, mask = batch["input_ids"], batch["aux_hidden_states"], batch["hidden_state"], batch["loss_mask"]
    length = ids.shape[1]
    trained = mask[:, 1:].bool()  # index j: x_{j+1} is an assistant token, the only targets a block is scored on
    row_of = torch.full(trained.shape, -1, dtype=torch.long, device=ids.device)
    row_of[trained] = torch.arange(int(trained.sum()), device=ids.device)
    with torch.no_grad():  # the target's state after x_j, predicting x_{j+1}, at trained j only
        picked = final[:, :-1][trained]
        picked = picked if len(picked) else final[:1, 0]  # no assistant token: one row, never scored
        in_vocab = draft.t2d[head.greedy(picked)]
        weight = head.lm_head.weight[draft_to_target(draft.d2t)]
    candidates = mask.bool().clone()
    candidates[:, length - 1 :] = False  # an anchor proposes at least one token inside the sequence
    anchors, present = sample_anchors(candidates, max_anchors if training else None)
    out = draft.training_forward(ids, aux.to(draft.fc.weight.dtype), anchors, positions, logits=False)  # [B,n,P,H]
    index = anchors[..., None] + torch.arange(positions, device=ids.device)  # proposing slot i reads index a + i
    previous = ids.gather(1, index.clamp(max=length - 1).flatten(1)).view(index.shape)  # x_{a+i}, before its target
    here = present[..., None] & (index < length - 1)
    rows = row_of.gather(1, index.clamp(max=length - 2).flatten(1)).view(index.shape)
    inside = here & (rows >= 0)  # [B, n, P]: the slot's target is an assistant token
    rows = rows.clamp(min=0)
    ok = inside & in_vocab[rows]  # ... and the target's top-1 is in the draft vocabulary: scored
    chunk = chunk_rows(ids.shape[0] * positions, draft.config.draft_vocab_size)
    scoring = Scoring(draft, head, picked, weight, kind, weighting, positions)
    parts = chunked(partial(score_blocks, scoring), chunk, out, rows, ok, previous)
    weighted, bce, error, selection, div, right = parts
    count = ok.sum()
    total = global_counts(count[None])[0] if training else count.clamp(min=1)
    loss = (weighted + auxiliary[0] * bce + auxiliary[1] * selection) / total
    sums: Sums = {"vocab_coverage": ratio(ok[..., 0].sum(), inside[..., 0].sum())}
    if draft.predicts_acceptance:
        sums["confidence_loss"] = ratio(bce.detach(), count)
        sums["confidence_error"] = ratio(error, count)
    if draft.selects_candidates:
        sums["selector_loss"] = ratio(selection.detach(), count)
    chains = ChainAccuracy()
    for d in range(positions):
        scored = ok[..., d]
        sums[key("loss", d)] = ratio((div[..., d] * scored).sum(), scored.sum())
        sums[key("acc", d)] = ratio((right[..., d] & scored).sum(), inside[..., d].sum())
        sums.update(chains.step(d, right[..., d] & scored, inside[..., d]))
    return loss, sums


class DFlashObjective(Objective):
    metric_names = ("loss", "acc", "full_acc", "cond_acc")

    def __init__(
        self,
        draft: DFlashDraft,
        head: TargetHead,
        positions: int,
        weighting: tuple[str, float, float],
        max_anchors: int,
        kind: Divergence,
        auxiliary: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        super().__init__(draft, head)
        self.steps, self.weighting, self.max_anchors, self.kind = positions, weighting, max_anchors, kind
        self.auxiliary = auxiliary
        if draft.predicts_acceptance:
            self.totals = (*self.totals, "confidence_loss", "confidence_error")
        if draft.selects_candidates:
            self.totals = (*self.totals, "selector_loss")

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Sums]:
        return block_loss(
            self.draft,
            batch,
            self.head,
            self.steps,
            self.weighting,
            self.max_anchors,
            self.kind,
            self.training,
            self.auxiliary,
        )
