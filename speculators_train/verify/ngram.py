"""The free baseline: n-gram prompt lookup in our loop, the draftless method vLLM serves as `ngram` (and llama.cpp
as its n-gram spec types). On the same prompts as the draft, it says whether training paid for them."""

from __future__ import annotations

import torch

from speculators_train.proposal import DraftTree, Sampling, TreeSpec
from speculators_train.target import NO_STATES

# vLLM's documented n-gram settings, which `verify --engine vllm` also runs (`engines/vllm/verify.py`)
LOOKUP_MAX, LOOKUP_MIN = 4, 2


class NgramProposer:
    """Proposes the tokens that followed the most recent earlier occurrence of the sequence's last n tokens (n from
    LOOKUP_MAX down to LOOKUP_MIN) in the prompt and the reply so far; nothing where none recurs, so that step is a
    plain decode (it still counts as a step: AL here is tokens per target pass)."""

    states = NO_STATES

    def __init__(self) -> None:
        self.history: list[int] = []

    def reset(self, first: int | None = None) -> None:
        self.history = [] if first is None else [first]

    def extend(self, tokens: list[int], states: torch.Tensor | None) -> None:
        self.history += tokens

    def lookup(self, k: int) -> list[int]:
        h = self.history
        for n in range(min(LOOKUP_MAX, len(h) - 1), LOOKUP_MIN - 1, -1):
            tail = h[-n:]
            for start in range(len(h) - n - 1, -1, -1):  # most recent first, the tail itself excluded
                if h[start : start + n] == tail:
                    return h[start + n : start + n + k]
        return []

    def propose_chain(
        self, k: int, sampling: Sampling, generator: torch.Generator | None
    ) -> tuple[list[int], torch.Tensor | None]:
        return self.lookup(k), None  # deterministic drafts: point masses at any temperature

    def propose_tree(self, spec: TreeSpec) -> DraftTree:
        chain = self.lookup(spec.depth)
        return DraftTree(chain, list(range(-1, len(chain) - 1)), list(range(1, len(chain) + 1)))
