"""Acceptance-guided data: which stored samples the draft being fine-tuned fails on.

Every sample is scored by the draft's teacher-forced acceptance length on it, 1 + sum_i full_acc_i over the
objective's chain steps (the same quantity validation predicts), and the `keep` share with the lowest scores is
trained on: training time goes where the draft loses acceptance, not to what it already drafts right. `uniform`
keeps a seeded random subset of the same size, the control to compare against.
"""

from __future__ import annotations

import math
import random

import torch

from speculators_train.families.objective import Objective, key
from speculators_train.hidden_states.shards import HiddenStateShards
from speculators_train.training.config import SelectConfig
from speculators_train.training.data import collate


def acceptance_lengths(objective: Objective, samples: HiddenStateShards, device: torch.device) -> list[float]:
    """Each sample's teacher-forced acceptance length under the objective's draft (inf where it trains no token,
    so it is kept last)."""
    was_training = objective.training
    objective.eval()
    scores = []
    with torch.no_grad():
        for index in range(len(samples)):
            batch = {k: v.to(device) for k, v in collate([samples[index]]).items()}
            _, sums = objective(batch)
            chains = [sums[key("full_acc", i)] for i in range(objective.steps)]
            if float(chains[0][1]) == 0:
                scores.append(math.inf)
            else:
                scores.append(1.0 + sum(float(c[0]) / max(float(c[1]), 1.0) for c in chains))
    objective.train(was_training)
    return scores


def select(cfg: SelectConfig, objective: Objective, samples: HiddenStateShards, seed: int, device) -> list[int]:
    """The indices of the train samples to keep."""
    count = max(1, round(cfg.keep * len(samples)))
    if cfg.by == "uniform":
        return sorted(random.Random(f"{seed}:select").sample(range(len(samples)), count))
    scores = acceptance_lengths(objective, samples, device)
    return sorted(sorted(range(len(samples)), key=lambda i: (scores[i], i))[:count])
