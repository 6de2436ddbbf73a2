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
from torch import nn

from speculators_train.models.eagle3 import Eagle3Draft
from speculators_train.models.vocab import draft_to_target
from speculators_train.training.divergence import Divergence, divergence


class TargetHead(nn.Module):
    """The target's final norm + lm_head, frozen: turns stored pre-norm states into target logits."""

    def __init__(self, norm: nn.Module, lm_head_weight: torch.Tensor) -> None:
        super().__init__()
        self.norm = norm
        self.lm_head = nn.Linear(lm_head_weight.shape[1], lm_head_weight.shape[0], bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head_weight)
        self.requires_grad_(False)

    def forward(self, final: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(final))


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
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted soft cross-entropy (or another divergence, `kind`) over the unrolled steps, and (numerator,
    denominator) metric sums.

    Returned metrics are sums, so they can be added over batches and ranks before dividing:
    `loss_i` / `n_i` (per-token CE over trained in-vocab tokens), `full_i` / `chains_i` (chains whose
    steps 0..i are all assistant tokens, and all right: a target outside the draft vocab counts as a
    miss, as it would at inference), `cond_n_i` (chains right before step i; cond_acc_i = full_i / cond_n_i).
    """
    a = align(batch, head, draft)
    logits = draft.ttt_forward(a.tokens, a.aux.to(draft.fc.weight.dtype), a.positions, steps)
    length = a.tokens.shape[1]
    counts = torch.stack([a.valid[:, i:].sum() for i in range(steps)])
    denominators = global_counts(counts) if across_ranks else counts.clamp(min=1)
    total = torch.zeros((), device=a.tokens.device)
    metrics: dict[str, torch.Tensor] = {}
    chain_ok = torch.ones_like(a.valid)  # chain j right (and trained) at every step so far
    chain_in = torch.ones_like(a.trained)  # chain j predicts assistant tokens at every step so far
    for i, step_logits in enumerate(logits):
        n = length - i
        lg = step_logits[:, :n].float()
        target = a.target_probs[:, i:]
        m = a.valid[:, i:]
        ce = divergence(target, torch.log_softmax(lg, dim=-1), kind, beta)  # [B, n]
        total = total + decay**i * (ce * m).sum() / denominators[i]
        correct = lg.argmax(-1) == target.argmax(-1)
        prev = chain_ok[:, :n]
        chain_in = chain_in[:, :n] & a.trained[:, i:]
        metrics[f"cond_n_{i}"] = (prev & chain_in).sum().float()  # chains still alive when step i starts
        chain_ok = prev & correct & m
        metrics[f"loss_{i}"] = (ce * m).sum().detach()
        metrics[f"n_{i}"] = counts[i].float()
        metrics[f"full_{i}"] = (chain_ok & chain_in).sum().float()
        metrics[f"chains_{i}"] = chain_in.sum().float()
    return total, metrics


def global_counts(counts: torch.Tensor) -> torch.Tensor:
    """Per-step token counts over all ranks, divided by the world size: DDP averages gradients over ranks,
    so a rank's loss sum / this equals the single-process mean over the whole global batch."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return counts.clamp(min=1)
    # One collective per micro-batch; every rank runs the same number of training micro-batches.
    total = counts.detach().clone()
    dist.all_reduce(total)
    return (total / dist.get_world_size()).clamp(min=1)


def summarize(sums: dict[str, float], steps: int, k: int | None = None) -> dict[str, float]:
    """Per-step loss / full_acc / cond_acc, and the acceptance length training predicts at k drafts.

    Under greedy verification chain j accepts at least i+1 drafts iff steps 0..i are right, so
    AL(k) = 1 + sum_{i<k} full_acc_i (the same sum vLLM reports, SPEC section 6).
    """
    out: dict[str, float] = {}
    for i in range(steps):
        n = max(sums[f"n_{i}"], 1.0)
        out[f"loss_{i}"] = sums[f"loss_{i}"] / n
        out[f"full_acc_{i}"] = sums[f"full_{i}"] / max(sums[f"chains_{i}"], 1.0)
        out[f"cond_acc_{i}"] = sums[f"full_{i}"] / max(sums[f"cond_n_{i}"], 1.0)
        if f"top1_{i}" in sums:  # Medusa: each head alone
            out[f"top1_acc_{i}"] = sums[f"top1_{i}"] / max(sums[f"tokens_{i}"], 1.0)
            out[f"top5_acc_{i}"] = sums[f"top5_{i}"] / max(sums[f"tokens_{i}"], 1.0)
            r = 0
            while f"rank{r}_{i}" in sums:
                out[f"rank{r}_acc_{i}"] = sums[f"rank{r}_{i}"] / max(sums[f"tokens_{i}"], 1.0)
                r += 1
    # Share of trained tokens the draft vocab can express at all: a ceiling on full_acc_0.
    out["vocab_coverage"] = sums["n_0"] / max(sums["chains_0"], 1.0)
    k = steps if k is None else min(k, steps)
    out[f"predicted_al_{k}"] = 1.0 + sum(out[f"full_acc_{i}"] for i in range(k))
    return out


class Eagle3Objective(nn.Module):
    """Draft + frozen target head; `forward(batch) -> (loss, metric sums)` is all the trainer calls.

    Wrapping this (not the bare draft) in DDP/DeepSpeed makes the whole TTT unroll one forward."""

    def __init__(
        self,
        draft: Eagle3Draft,
        head: TargetHead,
        steps: int,
        decay: float,
        kind: Divergence = "ce",
        beta: float = 0.5,
    ) -> None:
        super().__init__()
        self.draft = draft
        self.head = head
        self.steps = steps
        self.decay = decay
        self.kind, self.beta = kind, beta
        self.metric_names = ("loss", "n", "full", "chains", "cond_n")

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return ttt_loss(
            self.draft, batch, self.head, self.steps, self.decay, self.training, kind=self.kind, beta=self.beta
        )
