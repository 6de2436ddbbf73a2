"""Draft proposers for the verify loop: EAGLE-3 drafts, Medusa heads, and an oracle for exactness tests.

Every proposer follows the decoder's bookkeeping: `extend(tokens, states)` commits the target's hidden states g_j
of newly verified positions together with the tokens x_{j+1} that follow them (the pair an EAGLE-3 draft reads, as
in training), after throwing away whatever was speculated since the last commit. Proposals never commit anything.
`state` names which target states a proposer reads: "aux" (the EAGLE-3 aux layers) or "final" (the last
decoder layer's pre-norm output, which Medusa heads read after the target's final norm).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from speculators_train.models.eagle3 import DraftCache, Eagle3Draft
from speculators_train.models.medusa import MedusaDraft
from speculators_train.models.vocab import draft_to_target
from speculators_train.verify.sampling import Sampling


@dataclass(frozen=True)
class TreeSpec:
    """EAGLE-2-style dynamic tree: `depth` draft steps, each expanding the `top_k` best nodes so far into
    `top_k` children each; the `budget` nodes with the highest path probability are verified."""

    top_k: int = 4
    depth: int = 5
    budget: int = 24
    # Medusa only: a fixed tree of rank paths chosen once from measured per-head accuracies (see `best_paths`).
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


class Proposer(Protocol):
    state: str  # "aux" or "final": the target states `extend` receives

    def reset(self) -> None: ...

    def extend(self, tokens: list[int], states: torch.Tensor) -> None: ...

    def propose_chain(
        self, k: int, sampling: Sampling, generator: torch.Generator | None
    ) -> tuple[list[int], torch.Tensor | None]: ...

    def propose_tree(self, spec: TreeSpec) -> DraftTree: ...


def _allowed_causal(cached: int, new: int, device: torch.device) -> torch.Tensor:
    """[new, cached + new]: every cached key, then causal among the new ones."""
    allowed = torch.ones(new, cached + new, dtype=torch.bool, device=device)
    allowed[:, cached:] = torch.ones(new, new, dtype=torch.bool, device=device).tril()
    return allowed


def best_paths(scores: Sequence[Sequence[float]], budget: int) -> list[tuple[int, ...]]:
    """The `budget` best rank paths, parents before children. `scores[d][r]` is the (log) value of taking the
    rank-r candidate at depth d+1, non-increasing in r; a path's value is the sum along it, so a child never beats
    its parent and a best-first walk yields every path after its parent. This is Medusa's greedy tree
    construction when the scores are log per-head accuracies, and a dynamic tree when they are log-probabilities."""
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


class Eagle3Proposer:
    """The EAGLE-3 draft with its own KV cache. Positions follow training: the pair (x_{j+1}, g_j) sits at
    RoPE position j+1, and the i-th speculative step after it at j+1+i."""

    state = "aux"

    def __init__(self, draft: Eagle3Draft) -> None:
        self.draft = draft.eval()
        self.device = next(draft.parameters()).device
        self.targets = draft_to_target(draft.d2t.to(self.device))  # target id of each draft id
        self.reset()

    def reset(self) -> None:
        self.cache = DraftCache()
        self.committed = 0  # hidden states g_0 .. g_{committed-1} are in the cache
        self.hidden: torch.Tensor | None = None  # pre-norm output at the last committed index [1, 1, H]
        self.logits: torch.Tensor | None = None  # its draft-vocab logits [D]

    def _step(
        self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.draft.decode(tokens[None], hidden, positions[None], self.cache, allowed)

    @torch.inference_mode()
    def extend(self, tokens: list[int], states: torch.Tensor) -> None:
        self.cache.crop(self.committed)
        m = len(tokens)
        dtype = self.draft.fc.weight.dtype
        hidden = self.draft.fc(states.to(self.device, dtype)[None])
        positions = torch.arange(self.committed + 1, self.committed + 1 + m, device=self.device)
        ids = torch.tensor(tokens, device=self.device)
        out, logits = self._step(ids, hidden, positions, _allowed_causal(self.committed, m, self.device))
        self.committed += m
        self.hidden, self.logits = out[:, -1:], logits[0, -1]

    @torch.inference_mode()
    def propose_chain(
        self, k: int, sampling: Sampling, generator: torch.Generator | None
    ) -> tuple[list[int], torch.Tensor | None]:
        """k tokens, each from the draft's argmax (greedy) or sampled from softmax(logits / T); for sampling also
        the draft distributions over the target vocabulary [k, V] that the rejection rule needs."""
        self.cache.crop(self.committed)
        hidden, logits = self.hidden, self.logits
        tokens: list[int] = []
        qs = []
        for i in range(k):
            if sampling.greedy:
                choice = logits.argmax()
            else:
                q = torch.softmax(logits.float() / sampling.temperature, dim=-1)
                choice = torch.multinomial(q, 1, generator=generator)[0]
                qs.append(q)
            tokens.append(int(self.targets[choice]))
            if i == k - 1:
                break
            position = torch.tensor([self.committed + 1 + i], device=self.device)
            allowed = torch.ones(1, len(self.cache) + 1, dtype=torch.bool, device=self.device)
            hidden, step_logits = self._step(self.targets[choice][None], hidden, position, allowed)
            logits = step_logits[0, -1]
        if sampling.greedy:
            return tokens, None
        q_target = torch.zeros(k, self.draft.config.target_vocab_size, device=self.device)
        q_target[:, self.targets] = torch.stack(qs)
        return tokens, q_target

    @torch.inference_mode()
    def propose_tree(self, spec: TreeSpec) -> DraftTree:
        """Expand the `top_k` most probable nodes per depth (one batched draft step each), then keep the
        `budget` most probable nodes overall; a node's path probability never exceeds its parent's, and ties
        go to the shallower node, so every kept node's parent is kept too."""
        self.cache.crop(self.committed)
        tokens: list[int] = []  # target ids
        parents: list[int] = []
        depths: list[int] = []
        scores: list[float] = []
        cache_slot: dict[int, int] = {}  # node -> index of its key in the draft cache, once fed

        def add_children(parent: int, logits: torch.Tensor, base: float) -> list[int]:
            logp = torch.log_softmax(logits.float(), dim=-1)
            top = logp.topk(spec.top_k)
            added = []
            for value, index in zip(top.values.tolist(), top.indices.tolist(), strict=True):
                tokens.append(int(self.targets[index]))
                parents.append(parent)
                depths.append(1 if parent < 0 else depths[parent] + 1)
                scores.append(base + value)
                added.append(len(tokens) - 1)
            return added

        if spec.paths is not None:
            raise ValueError("a measured tree is built from Medusa head accuracies; EAGLE-3 drafts grow their own")
        frontier = add_children(-1, self.logits, 0.0)
        parent_hidden = {node: self.hidden[0, 0] for node in frontier}
        for depth in range(2, spec.depth + 1):
            fed = len(self.cache)
            allowed = torch.zeros(len(frontier), fed + len(frontier), dtype=torch.bool, device=self.device)
            allowed[:, : self.committed] = True
            for row, node in enumerate(frontier):
                allowed[row, fed + row] = True
                ancestor = parents[node]
                while ancestor >= 0:
                    allowed[row, cache_slot[ancestor]] = True
                    ancestor = parents[ancestor]
            ids = torch.tensor([tokens[n] for n in frontier], device=self.device)
            hidden = torch.stack([parent_hidden[n] for n in frontier])[None]
            positions = torch.full((len(frontier),), self.committed + depth - 1, device=self.device)
            out, logits = self._step(ids, hidden, positions, allowed)
            candidates = []
            for row, node in enumerate(frontier):
                cache_slot[node] = fed + row
                for child in add_children(node, logits[0, row], scores[node]):
                    parent_hidden[child] = out[0, row]
                    candidates.append(child)
            frontier = sorted(candidates, key=lambda n: -scores[n])[: spec.top_k]
        order = sorted(range(len(tokens)), key=lambda n: (-scores[n], depths[n]))
        kept: list[int] = []
        kept_set: set[int] = set()
        for node in order:
            if len(kept) == spec.budget:
                break
            if parents[node] < 0 or parents[node] in kept_set:
                kept.append(node)
                kept_set.add(node)
        kept.sort(key=lambda n: (depths[n], -scores[n]))
        index = {node: i for i, node in enumerate(kept)}
        return DraftTree(
            tokens=[tokens[n] for n in kept],
            parents=[index[parents[n]] if parents[n] >= 0 else -1 for n in kept],
            depths=[depths[n] for n in kept],
        )


class MedusaProposer:
    """Medusa heads over the target's last post-norm state: after verification the state at the last accepted
    position gives the target's next token (the pending one) through lm_head, and head h the token h+1 after it.
    No cache: the heads read one state and never see their own proposals."""

    state = "final"

    def __init__(self, draft: MedusaDraft, final_norm: nn.Module) -> None:
        self.draft = draft.eval()
        self.final_norm = final_norm
        self.device = next(draft.parameters()).device
        self.targets = draft_to_target(draft.d2t.to(self.device))
        self.reset()

    def reset(self) -> None:
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
        """Head h's argmax (greedy) or a sample from its softmax(logits / T); each head's distribution is fixed
        before any draft is drawn, so it is exactly the q the rejection rule needs."""
        self._heads(k)
        logits = self.logits[:k]
        if sampling.greedy:
            return self.targets[logits.argmax(-1)].tolist(), None
        q = torch.softmax(logits / sampling.temperature, dim=-1)
        choices = torch.multinomial(q, 1, generator=generator)[:, 0]
        q_target = torch.zeros(k, self.draft.config.target_vocab_size, device=self.device)
        q_target[:, self.targets] = q
        return self.targets[choices].tolist(), q_target

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
        top = torch.log_softmax(self.logits[:depth], dim=-1).topk(width, dim=-1)
        candidates = self.targets[top.indices].tolist()
        paths = list(spec.paths) if spec.paths is not None else best_paths(top.values.tolist(), spec.budget)
        return tree_from_paths(paths, candidates)


def measured_tree(rank_accuracy: list[list[float]], budget: int) -> tuple[tuple[int, ...], ...]:
    """Medusa's tree from held-out accuracies: `rank_accuracy[h][r]` is how often head h's rank-r candidate is
    the target's token; a path's expected acceptance is the product along it (heads taken as independent), and
    the `budget` paths with the highest products are kept."""
    floor = 1e-9  # a rank never right still orders after every rank that was
    scores = [[math.log(max(a, floor)) for a in sorted(row, reverse=True)] for row in rank_accuracy]
    order = [sorted(range(len(row)), key=lambda r: -row[r]) for row in rank_accuracy]
    return tuple(tuple(order[d][r] for d, r in enumerate(path)) for path in best_paths(scores, budget))


class OracleProposer:
    """Proposes a known continuation (the target's own greedy decode): with greedy verification every draft must
    be accepted, so acceptance length is K+1. Past the end of `reference` it proposes `filler`."""

    def __init__(self, reference: list[int], filler: int = 0) -> None:
        self.reference = reference
        self.filler = filler
        self.reset()

    state = "aux"

    def reset(self) -> None:
        self.length = 1  # tokens known to the proposer: x_0 plus every committed x_{j+1}

    def extend(self, tokens: list[int], states: torch.Tensor) -> None:
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
