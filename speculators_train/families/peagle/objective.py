"""P-EAGLE's objective: every depth from one forward, on the EAGLE alignment (`eagle.align`).

The chain anchored at index j predicts at depth d the target at index j + d (token x_{j+2+d}), with that index's
loss mask and in-vocab check. Training samples chains across depths (`model.sample_chains`); validation scores
every chain. The loss is the divergence summed over every scored (trained, in-vocab) element of every depth and
divided by their count, with no per-depth weight, as the paper trains.

Metrics per depth d: `loss_d`, `acc_d` (the draft's top-1 is the target's at depth d, over trained targets), and
the chain accuracies `full_acc_d` / `cond_acc_d` of `families.objective` over the chains scored at depth d (each
right at depths 0..d): with uniformly sampled chains they estimate the same ratios as scoring every chain, so
AL(k) = 1 + sum_{d<k} full_acc_d still predicts the loop's acceptance.
"""

from __future__ import annotations

import torch

from speculators_train.chunks import chunk_rows, chunked
from speculators_train.families.divergence import Divergence, divergence
from speculators_train.families.eagle.align import align
from speculators_train.families.objective import Objective, Sums, global_counts, key, ratio
from speculators_train.families.peagle.model import PEagleDraft, sample_chains
from speculators_train.head import TargetHead


def scatter_any(index: torch.Tensor, flags: torch.Tensor, length: int) -> torch.Tensor:
    """[B, length] bool: any of `flags` [B, n] at `index` [B, n] (indices may repeat)."""
    out = torch.zeros(index.shape[0], length, dtype=torch.long, device=index.device)
    return out.scatter_add_(1, index, flags.long()) > 0


def parallel_loss(
    draft: PEagleDraft,
    batch: dict[str, torch.Tensor],
    head: TargetHead,
    depths: int,
    ratio_kept: tuple[float, float],
    kind: Divergence,
    training: bool,
) -> tuple[torch.Tensor, Sums]:
    a = align(batch, head, draft)
    chains = sample_chains(a.trained, depths, *ratio_kept, everything=not training)
    outputs = draft.parallel_forward(a.tokens, a.aux.to(draft.fc.weight.dtype), a.positions, chains, logits=False)
    batch_size, length = a.tokens.shape
    rows = torch.arange(batch_size, device=a.tokens.device)[:, None]
    chunk = chunk_rows(batch_size, draft.config.draft_vocab_size)

    def piece(out: torch.Tensor, final: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lg = draft.lm_head(out).float()
        target = a.target_probs(head, final)
        return (divergence(target, torch.log_softmax(lg, dim=-1), kind) * m).sum(), lg.argmax(-1) == target.argmax(-1)

    per_depth = []  # (loss sum, right, valid, trained) of each depth's elements (padding: not valid, not trained)
    anchors = torch.arange(length, device=a.tokens.device).expand(batch_size, -1)
    present = torch.ones_like(a.trained)
    for d, out in enumerate(outputs):
        if d:
            anchors, present = chains.anchors[d - 1], chains.present[d - 1]
        index = (anchors + d).clamp(max=length - 1)
        valid = a.valid[rows, index] & present
        loss_sum, right = chunked(piece, chunk, out, a.final[rows, index], valid)
        per_depth.append((loss_sum, right, valid, a.trained[rows, index] & present))
    counts = torch.stack([valid.sum() for _, _, valid, _ in per_depth])
    total_count = global_counts(counts.sum()[None])[0] if training else counts.sum().clamp(min=1)
    loss = sum(loss_sum for loss_sum, _, _, _ in per_depth) / total_count
    sums: Sums = {"vocab_coverage": ratio(counts[0], a.trained.sum())}
    ok = inside = a.trained  # per anchor [B, L]: the chain is right / trained at every depth so far (set at d 0)
    for d, (loss_sum, right, valid, trained) in enumerate(per_depth):
        sums[key("loss", d)] = ratio(loss_sum, counts[d])
        sums[key("acc", d)] = ratio((right & valid).sum(), trained.sum())
        if d == 0:
            prev_ok, prev_inside = torch.ones_like(right), torch.ones_like(right)
        else:
            at = chains.anchors[d - 1]
            prev_ok, prev_inside = ok.gather(1, at), inside.gather(1, at)
        now_inside = prev_inside & trained
        now_ok = prev_ok & right & valid
        sums[key("full_acc", d)] = ratio((now_ok & now_inside).sum(), now_inside.sum())
        sums[key("cond_acc", d)] = ratio((now_ok & now_inside).sum(), (prev_ok & now_inside).sum())
        if d == 0:
            ok, inside = now_ok, now_inside
        else:  # back to per-anchor tensors; padding slots (anchor 0, all false) add nothing
            ok, inside = scatter_any(at, now_ok, length), scatter_any(at, now_inside, length)
    for d in range(len(per_depth), depths):  # a batch too short to reach depth d still names every metric
        zero = torch.zeros((), device=a.tokens.device)
        for name in PEagleObjective.metric_names:
            sums[key(name, d)] = ratio(zero, zero)
    return loss, sums


class PEagleObjective(Objective):
    metric_names = ("loss", "acc", "full_acc", "cond_acc")

    def __init__(
        self, draft: PEagleDraft, head: TargetHead, depths: int, ratio_kept: tuple[float, float], kind: Divergence
    ) -> None:
        super().__init__(draft, head)
        self.steps, self.ratio_kept, self.kind = depths, ratio_kept, kind

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Sums]:
        return parallel_loss(self.draft, batch, self.head, self.steps, self.ratio_kept, self.kind, self.training)
