"""What every family's objective returns, and the metrics they share.

An objective is the draft and the frozen target head as one module: `forward(batch) -> (loss, sums)`, so wrapping
it (not the bare draft) in DDP or DeepSpeed makes a family's whole forward one call. Metrics are sums, a
[numerator, denominator] pair per name, so they add over batches and ranks before dividing; every name is built
from (metric, step) by `key`, never parsed back.

Chain accuracies (the same for every family that drafts a chain): step i of the chain starting at position j is
accepted by a greedy verifier iff steps 0..i are all right, so with

    full_acc_i = chains right at steps 0..i / chains whose steps 0..i predict assistant tokens
    cond_acc_i = chains right at steps 0..i / chains right before step i

the acceptance length training predicts at k drafts is AL(k) = 1 + sum_{i<k} full_acc_i, the sum vLLM reports.
"""

from __future__ import annotations

import torch
from torch import nn

Sums = dict[str, torch.Tensor]  # name -> tensor([numerator, denominator])


def key(name: str, step: int) -> str:
    return f"{name}_{step}"


def ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """[numerator, denominator] in float32 at least (counts are integers; a float64 loss keeps its precision)."""
    dtype = torch.promote_types(numerator.dtype, torch.float32)
    return torch.stack([numerator.detach().to(dtype), denominator.detach().to(dtype)])


def predicted_al_key(k: int) -> str:
    return f"predicted_al_{k}"


class ChainAccuracy:
    """Accumulates the chain accuracies of one batch, step by step (each step's tensors are the positions whose
    chain is still `n` long: [B, n], n shrinking with the step)."""

    def __init__(self) -> None:
        self.ok: torch.Tensor | None = None  # chain right (and counted) at every step so far
        self.inside: torch.Tensor | None = None  # chain predicts assistant tokens at every step so far

    def step(self, i: int, right: torch.Tensor, trained: torch.Tensor) -> Sums:
        """`right`: the draft's top-1 is the target's (and inside the draft vocab); `trained`: the predicted token is
        an assistant token."""
        n = right.shape[1]
        prev = self.ok[:, :n] if self.ok is not None else torch.ones_like(right)
        self.inside = (self.inside[:, :n] if self.inside is not None else torch.ones_like(trained)) & trained
        alive = (prev & self.inside).sum()  # chains right before step i
        self.ok = prev & right
        full = (self.ok & self.inside).sum()
        return {key("full_acc", i): ratio(full, self.inside.sum()), key("cond_acc", i): ratio(full, alive)}


def summarize(sums: dict[str, list[float] | torch.Tensor], k: int) -> dict[str, float]:
    """Each metric as numerator / denominator (an empty denominator counts as 1), and the acceptance length
    predicted at `k` drafts (k at most the steps the objective scores)."""
    out = {name: float(pair[0]) / max(float(pair[1]), 1.0) for name, pair in sums.items()}
    out[predicted_al_key(k)] = 1.0 + sum(out[key("full_acc", i)] for i in range(k))
    return out


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


class Objective(nn.Module):
    """Draft + frozen target head; subclasses set `steps` (rows of per-step metrics), `metric_names` (the
    per-step metrics `forward` returns) and `totals` (its metrics over all steps)."""

    steps: int
    metric_names: tuple[str, ...]
    totals: tuple[str, ...] = ("vocab_coverage",)

    def __init__(self, draft: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.draft = draft
        self.head = head

    @property
    def columns(self) -> tuple[str, ...]:
        """The per-step metrics a report shows after training: all of `metric_names` unless a family keeps some
        for itself (Medusa's rank accuracies, from which it builds its tree)."""
        return self.metric_names

    @property
    def metric_keys(self) -> list[str]:
        """Every key `forward` returns: each rank sums all of them, in this order, even with no batch of its own."""
        return [key(name, i) for name in self.metric_names for i in range(self.steps)] + list(self.totals)
