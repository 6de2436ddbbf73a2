"""Scoring traffic for online distillation: a draft's teacher-forced acceptance on logged records (through its
family's objective), the buffer of records it fails on most, and the promotion gate."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch import nn

from speculators_train.families.base import Family
from speculators_train.families.objective import predicted_al_key, summarize
from speculators_train.head import TargetHead
from speculators_train.training.data import collate

Sample = dict[str, torch.Tensor]


@dataclass
class Scored:
    id: str
    sample: Sample
    acceptance: float  # teacher-forced AL(K) of the current draft on this record
    rejected: float  # share of scored positions whose first draft token is wrong: the buffer's priority


class Buffer:
    """At most `capacity` records, favouring those where the draft was rejected most: when full, a new record
    replaces the most-accepted one only if it was rejected more. Batches are drawn in proportion to rejection."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items: list[Scored] = []

    def add(self, item: Scored) -> bool:
        if len(self.items) < self.capacity:
            self.items.append(item)
            return True
        easiest = min(range(len(self.items)), key=lambda i: self.items[i].rejected)
        if item.rejected <= self.items[easiest].rejected:
            return False
        self.items[easiest] = item
        return True

    def batch(self, size: int, rng: random.Random) -> list[Sample]:
        weights = [item.rejected + 0.05 for item in self.items]  # a fully accepted record keeps a small chance
        return [item.sample for item in rng.choices(self.items, weights=weights, k=min(size, len(self.items)))]


def on_device(batch: dict[str, torch.Tensor], like: nn.Module) -> dict[str, torch.Tensor]:
    device = next(like.parameters()).device
    return {name: tensor.to(device) for name, tensor in batch.items()}


class Scorer:
    """Teacher-forced acceptance of a draft on samples, through its family's objective scoring K draft steps."""

    def __init__(self, family: Family, head: TargetHead, settings, k: int) -> None:
        self.family, self.head, self.settings, self.k = family, head, settings, k

    def summary(self, draft: nn.Module, samples: list[Sample], batch_size: int) -> tuple[dict[str, float], str]:
        """The objective's metrics over `samples` (positions pooled), and the key of the predicted AL in them."""
        objective = self.family.objective(draft, self.head, self.settings, depth=self.k).eval()
        sums: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for start in range(0, len(samples), batch_size):
                _, metrics = objective(on_device(collate(samples[start : start + batch_size]), self.head))
                for name, pair in metrics.items():
                    sums[name] = sums[name] + pair if name in sums else pair
        k = min(self.k, objective.steps)
        return summarize(sums, k), predicted_al_key(k)

    def acceptance(self, draft: nn.Module, samples: list[Sample], batch_size: int = 4) -> float:
        """Teacher-forced AL(k) over samples; 1.0 (nothing accepted) for none."""
        if not samples:
            return 1.0
        summary, al = self.summary(draft, samples, batch_size)
        return summary[al]

    def score(self, draft: nn.Module, record_id: str, sample: Sample) -> Scored:
        summary, al = self.summary(draft, [sample], 1)
        return Scored(record_id, sample, summary[al], 1.0 - summary["full_acc_0"])


def gate(
    candidate: tuple[float, float], current: tuple[float, float], margin: float, min_gain: float
) -> tuple[bool, str]:
    """(promote?, why) from (log-slice AL, general AL) of the candidate and of the reference: the current version's
    log-slice AL, and the general AL of the first deployed version."""
    (log_new, general_new), (log_old, general_old) = candidate, current
    if log_new <= log_old + min_gain:  # "beats": strictly
        return False, f"log-slice AL {log_new:.3f} does not beat the current {log_old:.3f} by {min_gain:g}"
    if general_new < general_old - margin:
        return False, f"general AL {general_new:.3f} lost more than {margin:g} from the deployed {general_old:.3f}"
    return True, f"log-slice AL {log_old:.3f} -> {log_new:.3f}, general {general_old:.3f} -> {general_new:.3f}"
