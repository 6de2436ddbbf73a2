"""A proposer that knows the answer, for exactness tests and the ceiling a machine allows (`bench_verify`)."""

from __future__ import annotations

import torch

from speculators_train.proposal import DraftTree, Sampling, TreeSpec
from speculators_train.target import NO_STATES


class OracleProposer:
    """Proposes a known continuation (the target's own greedy decode): with greedy verification every draft must
    be accepted, so acceptance length is K+1. Past the end of `reference` it proposes `filler`."""

    def __init__(self, reference: list[int], filler: int = 0) -> None:
        self.reference = reference
        self.filler = filler
        self.reset()

    states = NO_STATES

    def reset(self, first: int | None = None) -> None:
        self.length = 1  # tokens known to the proposer: x_0 plus every committed x_{j+1}

    def extend(self, tokens: list[int], states: torch.Tensor | None) -> None:
        self.length += len(tokens)

    def _next(self, k: int) -> list[int]:
        out = self.reference[self.length : self.length + k]
        return out + [self.filler] * (k - len(out))

    def propose_chain(
        self, k: int, sampling: Sampling, generator: torch.Generator | None
    ) -> tuple[list[int], torch.Tensor | None]:
        if not sampling.greedy:
            raise ValueError("the oracle proposer has no draft distribution; use it with greedy verification")
        return self._next(k), None

    def propose_tree(self, spec: TreeSpec) -> DraftTree:
        """The oracle chain, plus a wrong sibling at every depth so the tree walk has to choose."""
        chain = self._next(spec.depth)
        tokens, parents, depths = [], [], []
        parent = -1
        for depth, token in enumerate(chain, start=1):
            tokens += [self.filler if token != self.filler else self.filler + 1, token]
            parents += [parent, parent]
            depths += [depth, depth]
            parent = len(tokens) - 1
        return DraftTree(tokens, parents, depths)
