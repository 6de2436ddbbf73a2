"""The EAGLE-3 draft as a proposer: chains (argmax or sampled drafts) and EAGLE-2-style dynamic trees, with its own KV
cache that rolls back to the committed positions before every proposal."""

from __future__ import annotations

import torch

from speculators_train.families.eagle.model import DraftCache, Eagle3Draft
from speculators_train.families.vocab import draft_to_target
from speculators_train.proposal import DraftTree, GrowingTree, Sampling, TreeSpec
from speculators_train.target import StateSpec


def _allowed_causal(cached: int, new: int, device: torch.device) -> torch.Tensor:
    """[new, cached + new]: every cached key, then causal among the new ones."""
    allowed = torch.ones(new, cached + new, dtype=torch.bool, device=device)
    allowed[:, cached:] = torch.ones(new, new, dtype=torch.bool, device=device).tril()
    return allowed


class Eagle3Proposer:
    """The EAGLE-3 draft with its own KV cache. Positions follow training: the pair (x_{j+1}, g_j) sits at
    RoPE position j+1, and the i-th speculative step after it at j+1+i."""

    def __init__(self, draft: Eagle3Draft, states: StateSpec) -> None:
        self.states = states
        self.draft = draft.eval()
        self.device = next(draft.parameters()).device
        self.targets = draft_to_target(draft.d2t.to(self.device))  # target id of each draft id
        self.reset()

    def reset(self, first: int | None = None) -> None:
        self.cache = DraftCache()
        self.committed = 0  # hidden states g_0 .. g_{committed-1} are in the cache
        self.hidden: torch.Tensor | None = None  # the fed-back output at the last committed index [1, 1, H]
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
        hidden = self.draft.fuse(states.to(self.device, dtype)[None])
        positions = torch.arange(self.committed + 1, self.committed + 1 + m, device=self.device)
        ids = torch.tensor(tokens, device=self.device)
        out, logits = self._step(ids, hidden, positions, _allowed_causal(self.committed, m, self.device))
        self.committed += m
        self.hidden, self.logits = out[:, -1:], logits[0, -1]

    @torch.inference_mode()
    def propose_chain(
        self, k: int, sampling: Sampling, generator: torch.Generator | None
    ) -> tuple[list[int], torch.Tensor | None]:
        """k tokens, each the draft's argmax or (`sampling.samples_drafts`) sampled from softmax(logits / T); for
        sampled drafts also the draft distributions over the target vocabulary [k, V] that the rejection rule needs."""
        self.cache.crop(self.committed)
        hidden, logits = self.hidden, self.logits
        tokens: list[int] = []
        qs = []
        for i in range(k):
            if not sampling.samples_drafts:
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
        if not sampling.samples_drafts:
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
        if spec.paths is not None:
            raise ValueError("a fixed tree of rank paths is for per-depth candidates; EAGLE-3 grows its own")
        tree = GrowingTree()
        frontier = tree.add_children(-1, self.logits, spec.top_k, self.targets)
        parent_hidden = {node: self.hidden[0, 0] for node in frontier}
        for depth in range(2, spec.depth + 1):
            allowed = tree.feed_mask(frontier, self.committed, len(self.cache), self.device)
            ids = torch.tensor([tree.tokens[n] for n in frontier], device=self.device)
            hidden = torch.stack([parent_hidden[n] for n in frontier])[None]
            positions = torch.full((len(frontier),), self.committed + depth - 1, device=self.device)
            out, logits = self._step(ids, hidden, positions, allowed)
            candidates = []
            for row, node in enumerate(frontier):
                for child in tree.add_children(node, logits[0, row], spec.top_k, self.targets):
                    parent_hidden[child] = out[0, row]
                    candidates.append(child)
            frontier = sorted(candidates, key=lambda n: -tree.scores[n])[: spec.top_k]
        return tree.best(spec.budget)
