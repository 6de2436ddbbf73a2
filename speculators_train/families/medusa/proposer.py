"""Medusa heads as a proposer (chains and trees from the heads' candidates), and Medusa's measured tree."""

from __future__ import annotations

import math

import torch
from torch import nn

from speculators_train.families.medusa.model import MedusaDraft
from speculators_train.families.vocab import draft_to_target
from speculators_train.proposal import DraftTree, Sampling, TreeSpec, best_paths, independent_chain, independent_tree
from speculators_train.target import StateSpec


class MedusaProposer:
    """Medusa heads over the target's last post-norm state: after verification the state at the last accepted
    position gives the target's next token (the pending one) through lm_head, and head h the token h+1 after it.
    No cache: the heads read one state and never see their own proposals."""

    def __init__(self, draft: MedusaDraft, final_norm: nn.Module, states: StateSpec) -> None:
        self.states = states
        self.draft = draft.eval()
        self.final_norm = final_norm
        self.device = next(draft.parameters()).device
        self.targets = draft_to_target(draft.d2t.to(self.device))
        self.reset()

    def reset(self, first: int | None = None) -> None:
        self.logits: torch.Tensor | None = None  # [heads, draft vocab] at the last committed position

    @torch.inference_mode()
    def extend(self, tokens: list[int], states: torch.Tensor) -> None:
        last = states[-1].to(self.device, self.draft.lm_heads[0].weight.dtype)
        self.logits = self.draft(self.final_norm(last)).float()

    def _heads(self, k: int) -> None:
        if k > self.draft.config.num_heads:
            raise ValueError(f"{k} draft tokens asked of {self.draft.config.num_heads} Medusa heads")

    @torch.inference_mode()
    def propose_chain(
        self, k: int, sampling: Sampling, generator: torch.Generator | None
    ) -> tuple[list[int], torch.Tensor | None]:
        """Head h's argmax or (`sampling.samples_drafts`) a sample from its softmax(logits / T); each head's
        distribution is fixed before any draft is drawn, so it is exactly the q the rejection rule needs."""
        self._heads(k)
        vocab = self.draft.config.target_vocab_size
        return independent_chain(self.logits[:k], self.targets, vocab, sampling, generator)

    @torch.inference_mode()
    def propose_tree(self, spec: TreeSpec) -> DraftTree:
        """A fixed measured tree (`spec.paths`), or the `budget` most probable paths of the heads' top-k
        candidates (head probabilities multiply along a path, as the heads are independent of each other)."""
        if spec.paths is not None:
            depth = max(map(len, spec.paths))
            width = 1 + max(r for path in spec.paths for r in path)
        else:
            depth, width = min(spec.depth, self.draft.config.num_heads), spec.top_k
        self._heads(depth)
        return independent_tree(self.logits[:depth], self.targets, width, spec.budget, spec.paths)


def measured_tree(rank_accuracy: list[list[float]], budget: int) -> tuple[tuple[int, ...], ...]:
    """Medusa's tree from held-out accuracies: `rank_accuracy[h][r]` is how often head h's rank-r candidate is
    the target's token; a path's expected acceptance is the product along it (heads taken as independent), and
    the `budget` paths with the highest products are kept."""
    floor = 1e-9  # a rank never right still orders after every rank that was
    scores = [[math.log(max(a, floor)) for a in sorted(row, reverse=True)] for row in rank_accuracy]
    order = [sorted(range(len(row)), key=lambda r: -row[r]) for row in rank_accuracy]
    return tuple(tuple(order[d][r] for d, r in enumerate(path)) for path in best_paths(scores, budget))
