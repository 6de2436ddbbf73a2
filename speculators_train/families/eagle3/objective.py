"""EAGLE-3 training-time test: loss against the target and per-step accuracies, on the alignment of
`eagle.align` (index j holds token x_{j+1}, fused state g_j, and predicts x_{j+2}).

Step i of the chain starting at j predicts x_{j+2+i}: its logits sit at index j, its target and mask
at index j+i. The mask moves with the target (the reference-implementation bug was to leave it behind).
Positions whose target top-1 is outside the draft vocabulary are masked too.
"""

from __future__ import annotations

import torch

from speculators_train.chunks import chunk_rows, chunked
from speculators_train.families.divergence import Divergence, divergence
from speculators_train.families.eagle.align import align
from speculators_train.families.eagle.model import Eagle3Draft
from speculators_train.families.objective import ChainAccuracy, Objective, Sums, global_counts, key, ratio
from speculators_train.head import TargetHead


def ttt_loss(
    draft: Eagle3Draft,
    batch: dict[str, torch.Tensor],
    head: TargetHead,
    steps: int,
    decay: float,
    across_ranks: bool = False,
    kind: Divergence = "ce",
    beta: float = 0.5,
) -> tuple[torch.Tensor, Sums]:
    """Weighted soft cross-entropy (or another divergence, `kind`) over the unrolled steps, and the metric sums:
    `loss_i` (per-token divergence over trained in-vocab tokens), the chain accuracies (a target outside the draft
    vocab counts as a miss, as it would at inference) and `vocab_coverage` (trained tokens the draft vocab can
    express at all: a ceiling on full_acc_0)."""
    a = align(batch, head, draft)
    outputs = draft.ttt_forward(a.tokens, a.aux.to(draft.fc.weight.dtype), a.positions, steps, logits=False)
    length = a.tokens.shape[1]
    counts = torch.stack([a.valid[:, i:].sum() for i in range(steps)])
    denominators = global_counts(counts) if across_ranks else counts.clamp(min=1)
    total = torch.zeros((), device=a.tokens.device)
    sums: Sums = {"vocab_coverage": ratio(counts[0], a.trained.sum())}
    chains = ChainAccuracy()
    rows = chunk_rows(a.tokens.shape[0], draft.config.draft_vocab_size)

    def piece(out: torch.Tensor, final: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        lg = draft.lm_head(out).float()
        target = a.target_probs(head, final)
        ce = divergence(target, torch.log_softmax(lg, dim=-1), kind, beta)  # [B, c]
        return (ce * m).sum(), lg.argmax(-1) == target.argmax(-1)

    for i, out in enumerate(outputs):
        n = length - i
        m = a.valid[:, i:]
        loss_sum, correct = chunked(piece, rows, out[:, :n], a.final[:, i:], m)
        total = total + decay**i * loss_sum / denominators[i]
        sums[key("loss", i)] = ratio(loss_sum, counts[i])
        sums.update(chains.step(i, correct & m, a.trained[:, i:]))
    return total, sums


class Eagle3Objective(Objective):
    metric_names = ("loss", "full_acc", "cond_acc")

    def __init__(self, draft: Eagle3Draft, head: TargetHead, steps: int, decay: float, kind: Divergence = "ce") -> None:
        super().__init__(draft, head)
        self.steps, self.decay, self.kind = steps, decay, kind

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Sums]:
        return ttt_loss(self.draft, batch, self.head, self.steps, self.decay, self.training, kind=self.kind)
