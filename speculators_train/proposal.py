"""What a proposer is, for the verify loop and every family's draft: the protocol, sampling settings and trees.

Every proposer follows the decoder's bookkeeping: `extend(tokens, states)` commits the target's hidden states g_j
of newly verified positions together with the tokens x_{j+1} that follow them (the pair an autoregressive draft
reads, as in training), after throwing away whatever was speculated since the last commit. Proposals never commit
anything. `states` says which target states `extend` receives (`target.StateSpec`: aux layers, the final
pre-norm state, or nothing).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from speculators_train.target import StateSpec


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    # At T > 0 a chain drafts the argmax (as vLLM and SGLang do; verified with q = a point mass) or samples each
    # draft token from softmax(logits / T). Both are exact under the rejection rule.
    draft_sampling: Literal["argmax", "sample"] = "argmax"
    # A chain stops before the first draft token whose predicted acceptance is below this (0: never); read by drafts
    # that predict it (a confidence head), as llama.cpp's --spec-draft-p-min.
    p_min: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def samples_drafts(self) -> bool:
        """Whether a chain proposer samples its drafts (and returns the q they were drawn from)."""
        return not self.greedy and self.draft_sampling == "sample"


@dataclass(frozen=True)
class TreeSpec:
    """EAGLE-2-style dynamic tree: `depth` draft steps, each expanding the `top_k` best nodes so far into
    `top_k` children each; the `budget` nodes with the highest path probability are verified."""

    top_k: int = 4
    depth: int = 5
    budget: int = 24
    # A fixed tree of rank paths chosen once (e.g. from measured per-head accuracies, see `best_paths`), which
    # replaces the dynamic expansion for drafts that propose independent candidates per depth.
    paths: tuple[tuple[int, ...], ...] | None = None

    def describe(self) -> str:
        if self.paths is not None:
            return f"tree(measured, depth={max(map(len, self.paths))}, budget={len(self.paths)})"
        return f"tree(top_k={self.top_k}, depth={self.depth}, budget={self.budget})"


@dataclass
class DraftTree:
    """Draft nodes in an order where parents precede children; parent -1 is the pending (last verified) token."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]  # 1 = child of the pending token
    children: dict[int, list[int]] = field(default_factory=dict)  # node (-1 = root) -> children, best first

    def __post_init__(self) -> None:
        if not self.children:
            for node, parent in enumerate(self.parents):
                self.children.setdefault(parent, []).append(node)


@dataclass
class GrowingTree:
    """An EAGLE-2-style dynamic tree as a draft that reads its own tokens grows it: each expanded node gets its
    `top_k` most probable children, scored by path log-probability. A child's score never exceeds its parent's,
    so a best-first cut (`best`) keeps every kept node's parent."""

    tokens: list[int] = field(default_factory=list)  # target ids
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    slots: dict[int, int] = field(default_factory=dict)  # node -> index of its key in the draft's cache, once fed

    def add_children(self, parent: int, logits: torch.Tensor, top_k: int, ids: torch.Tensor | None = None) -> list[int]:
        """The `top_k` best children of `parent` (-1: the pending token) under `logits`; `ids` maps a logit index
        to its target id (a reduced draft vocabulary), else the index is the id."""
        top = torch.log_softmax(logits.float(), dim=-1).topk(top_k)
        base = 0.0 if parent < 0 else self.scores[parent]
        added = []
        for value, index in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            self.tokens.append(index if ids is None else int(ids[index]))
            self.parents.append(parent)
            self.depths.append(1 if parent < 0 else self.depths[parent] + 1)
            self.scores.append(base + value)
            added.append(len(self.tokens) - 1)
        return added

    def ancestors(self, node: int) -> list[int]:
        """`node`'s parent, its parent's parent, ... (the pending token excluded)."""
        out, parent = [], self.parents[node]
        while parent >= 0:
            out.append(parent)
            parent = self.parents[parent]
        return out

    def feed_mask(self, frontier: list[int], committed: int, fed: int, device: torch.device) -> torch.Tensor:
        """[len(frontier), fed + len(frontier)], True = attend: `frontier` fed at once to a draft whose cache holds
        `fed` keys, the first `committed` of them committed tokens. Each node sees those, its ancestors and itself;
        where its own key lands is recorded for its children."""
        allowed = torch.zeros(len(frontier), fed + len(frontier), dtype=torch.bool, device=device)
        allowed[:, :committed] = True
        for row, node in enumerate(frontier):
            self.slots[node] = fed + row
            allowed[row, fed + row] = True
            for ancestor in self.ancestors(node):
                allowed[row, self.slots[ancestor]] = True
        return allowed

    def best(self, budget: int) -> DraftTree:
        """The `budget` most probable nodes (ties to the shallower), parents before children."""
        order = sorted(range(len(self.tokens)), key=lambda n: (-self.scores[n], self.depths[n]))
        kept: list[int] = []
        kept_set: set[int] = set()
        for node in order:
            if len(kept) == budget:
                break
            if self.parents[node] < 0 or self.parents[node] in kept_set:
                kept.append(node)
                kept_set.add(node)
        kept.sort(key=lambda n: (self.depths[n], -self.scores[n]))
        index = {node: i for i, node in enumerate(kept)}
        return DraftTree(
            tokens=[self.tokens[n] for n in kept],
            parents=[index[self.parents[n]] if self.parents[n] >= 0 else -1 for n in kept],
            depths=[self.depths[n] for n in kept],
        )


class Proposer(Protocol):
    states: StateSpec  # the target states `extend` receives

    def reset(self, first: int | None) -> None:
        """A new sequence beginning with token `first` (the one no target state precedes; a draft that reads tokens
        needs it)."""
        ...

    def extend(self, tokens: list[int], states: torch.Tensor | None) -> None: ...

    def propose_chain(
        self, k: int, sampling: Sampling, generator: torch.Generator | None
    ) -> tuple[list[int], torch.Tensor | None]:
        """k draft tokens, and the [k, V] distributions they were sampled from (None: each draft is deterministic,
        a point mass, as with greedy decoding or `draft_sampling: argmax`)."""
        ...

    def propose_tree(self, spec: TreeSpec) -> DraftTree: ...


def best_paths(scores: Sequence[Sequence[float]], budget: int) -> list[tuple[int, ...]]:
    """The `budget` best rank paths, parents before children. `scores[d][r]` is the (log) value of taking the
    rank-r candidate at depth d+1, non-increasing in r; a path's value is the sum along it, so a child never beats
    its parent and a best-first walk yields every path after its parent. With log per-head accuracies as scores
    this is the greedy construction of a fixed (measured) tree; with log-probabilities, a dynamic tree."""
    heap = [(-scores[0][r], (r,)) for r in range(len(scores[0]))]
    heapq.heapify(heap)
    out: list[tuple[int, ...]] = []
    while heap and len(out) < budget:
        negative, path = heapq.heappop(heap)
        out.append(path)
        if len(path) < len(scores):
            for r, value in enumerate(scores[len(path)]):
                heapq.heappush(heap, (negative - value, (*path, r)))
    return out


def tree_from_paths(paths: list[tuple[int, ...]], candidates: list[list[int]]) -> DraftTree:
    """A draft tree whose node for rank path (r_1..r_d) holds candidates[d-1][r_d]; parents precede children."""
    index = {path: i for i, path in enumerate(paths)}
    return DraftTree(
        tokens=[candidates[len(path) - 1][path[-1]] for path in paths],
        parents=[index[path[:-1]] if len(path) > 1 else -1 for path in paths],
        depths=[len(path) for path in paths],
    )


def independent_chain(
    logits: torch.Tensor, targets: torch.Tensor, vocab_size: int, sampling: Sampling, generator: torch.Generator | None
) -> tuple[list[int], torch.Tensor | None]:
    """A chain from per-position draft-vocab `logits` [k, D] fixed before any draft is drawn (heads, or depths that
    read no draft token): each position's argmax, or (`sampling.samples_drafts`) a sample of softmax(logits / T)
    with those distributions over the target vocabulary [k, vocab_size] as the q the rejection rule needs.
    `targets`: the target id of each draft id."""
    if not sampling.samples_drafts:
        return targets[logits.argmax(-1)].tolist(), None
    q = torch.softmax(logits / sampling.temperature, dim=-1)
    choices = torch.multinomial(q, 1, generator=generator)[:, 0]
    q_target = torch.zeros(logits.shape[0], vocab_size, device=logits.device)
    q_target[:, targets] = q
    return targets[choices].tolist(), q_target


def independent_tree(
    logits: torch.Tensor, targets: torch.Tensor, width: int, budget: int, paths: Sequence[tuple[int, ...]] | None
) -> DraftTree:
    """A tree over per-depth candidates that read no draft token (`logits` [depth, D]): the `width` best of each
    depth, and the given rank `paths` or else the `budget` most probable (probabilities multiply along a path)."""
    top = torch.log_softmax(logits, dim=-1).topk(width, dim=-1)
    chosen = list(paths) if paths is not None else best_paths(top.values.tolist(), budget)
    return tree_from_paths(chosen, targets[top.indices].tolist())
