"""EAGLE-3 training-time test: batch alignment, loss against the target, per-step accuracies.

Alignment (T tokens from the generator; g = aux states, y = pre-norm final states, l = loss mask):

    tokens   [x0  x1  x2  x3 ...]      index j of the shifted batch holds
    aux      [g0  g1  g2  g3 ...]        token x_{j+1}, fused state g_j, RoPE position j+1,
    final    [y0  y1  y2  y3 ...]        target distribution from y_{j+1} (it predicts x_{j+2}),
    mask     [l0  l1  l2  l3 ...]        mask l_{j+2}: the mask of the token being predicted.

Step i of the chain starting at j predicts x_{j+2+i}: its logits sit at index j, its target and mask
at index j+i. The mask moves with the target (the reference-implementation bug was to leave it behind).
Positions whose target top-1 is outside the draft vocabulary are masked too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from speculators_train.families.divergence import Divergence, divergence
from speculators_train.families.eagle3.model import Eagle3Draft
from speculators_train.families.objective import ChainAccuracy, Objective, Sums, global_counts, key, ratio
from speculators_train.families.vocab import draft_to_target
from speculators_train.target import TargetHead


@dataclass
class Aligned:
    tokens: torch.Tensor  # [B, L] x_{j+1}
    aux: torch.Tensor  # [B, L, A*H] g_j
    positions: torch.Tensor  # [B, L] j+1
    target_probs: torch.Tensor  # [B, L, draft_vocab] target distribution over the draft vocab
    trained: torch.Tensor  # [B, L] bool: the predicted token is an assistant token (loss mask l_{j+2})
    valid: torch.Tensor  # [B, L] bool: trained, and the target's top-1 is in the draft vocab


def align(batch: dict[str, torch.Tensor], head: TargetHead, draft: Eagle3Draft) -> Aligned:
    ids, aux, final, mask = batch["input_ids"], batch["aux_hidden_states"], batch["hidden_state"], batch["loss_mask"]
    length = ids.shape[1] - 1
    predicted_mask = F.pad(mask[:, 2:], (0, 1), value=False)  # l_{j+2}
    with torch.no_grad():
        logits = head(final[:, 1:].to(head.lm_head.weight.dtype)).float()  # [B, L, V_target]
        in_vocab = draft.t2d[logits.argmax(-1)]
        probs = torch.softmax(logits[..., draft_to_target(draft.d2t)], dim=-1)
    positions = torch.arange(1, length + 1, device=ids.device).expand(ids.shape[0], -1)
    return Aligned(ids[:, 1:], aux[:, :-1], positions, probs, predicted_mask, predicted_mask & in_vocab)


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
    logits = draft.ttt_forward(a.tokens, a.aux.to(draft.fc.weight.dtype), a.positions, steps)
    length = a.tokens.shape[1]
    counts = torch.stack([a.valid[:, i:].sum() for i in range(steps)])
    denominators = global_counts(counts) if across_ranks else counts.clamp(min=1)
    total = torch.zeros((), device=a.tokens.device)
    sums: Sums = {"vocab_coverage": ratio(counts[0], a.trained.sum())}
    chains = ChainAccuracy()
    for i, step_logits in enumerate(logits):
        n = length - i
        lg = step_logits[:, :n].float()
        target = a.target_probs[:, i:]
        m = a.valid[:, i:]
        ce = divergence(target, torch.log_softmax(lg, dim=-1), kind, beta)  # [B, n]
        total = total + decay**i * (ce * m).sum() / denominators[i]
        correct = lg.argmax(-1) == target.argmax(-1)
        sums[key("loss", i)] = ratio((ce * m).sum(), counts[i])
        sums.update(chains.step(i, correct & m, a.trained[:, i:]))
    return total, sums


class Eagle3Objective(Objective):
    metric_names = ("loss", "full_acc", "cond_acc")

    def __init__(self, draft: Eagle3Draft, head: TargetHead, steps: int, decay: float, kind: Divergence = "ce") -> None:
        super().__init__(draft, head)
        self.steps, self.decay, self.kind = steps, decay, kind

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Sums]:
        return ttt_loss(self.draft, batch, self.head, self.steps, self.decay, self.training, kind=self.kind)
