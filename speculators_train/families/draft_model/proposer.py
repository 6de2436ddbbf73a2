"""A standalone draft as a proposer: its own KV cache over the committed tokens, K autoregressive steps per
proposal (or a dynamic tree), the cache cropped back to the committed tokens before the next commit."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from speculators_train.families.draft_model.model import StandaloneDraft
from speculators_train.proposal import DraftTree, GrowingTree, Sampling, TreeSpec
from speculators_train.target import StateSpec


class DraftModelProposer:
    """Reads tokens only: after `extend`, its logits at the last committed token (the pending one) give the first
    draft token."""

    def __init__(self, draft: StandaloneDraft, states: StateSpec) -> None:
        self.states = states
        self.draft = draft.eval()
        self.device = next(draft.parameters()).device
        self.reset(None)

    def reset(self, first: int | None) -> None:
        self.cache = DynamicCache()
        self.tokens: list[int] = [] if first is None else [first]
        self.cached = 0  # tokens whose keys and values are in the cache (the committed ones)
        self.logits: torch.Tensor | None = None

    def _drop_drafts(self) -> None:
        """The cache back to the committed tokens. `crop` is given a negative count, which every transformers
        release reads as "remove this many" (a positive one is a length in some releases, deprecated in others),
        and is not called with 0, which older releases read as "keep none"."""
        extra = self.cache.get_seq_length() - self.cached
        if extra > 0:
            self.cache.crop(-extra)

    def _step(self, tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor([tokens], device=self.device)
        out = self.draft(ids, past_key_values=self.cache, use_cache=True)
        return out.logits[0, -1].float()

    @torch.inference_mode()
    def extend(self, tokens: list[int], states: torch.Tensor | None) -> None:
        self._drop_drafts()
        self.tokens.extend(tokens)
        self.logits = self._step(self.tokens[self.cached :])
        self.cached = len(self.tokens)

    @torch.inference_mode()
    def propose_chain(
        self, k: int, sampling: Sampling, generator: torch.Generator | None
    ) -> tuple[list[int], torch.Tensor | None]:
        """Each step's argmax, or (`sampling.samples_drafts`) a sample of softmax(logits / T) with that
        distribution as the q the rejection rule needs."""
        logits, drafts, qs = self.logits, [], []
        for step in range(k):
            if sampling.samples_drafts:
                q = torch.softmax(logits / sampling.temperature, dim=-1)
                token = int(torch.multinomial(q, 1, generator=generator))  # the generator is on the loop's device
                qs.append(q)
            else:
                token = int(logits.argmax())
            drafts.append(token)
            if step < k - 1:
                logits = self._step([token])
        self._drop_drafts()
        return drafts, torch.stack(qs) if qs else None

    @torch.inference_mode()
    def propose_tree(self, spec: TreeSpec) -> DraftTree:
        """An EAGLE-2-style dynamic tree: each depth feeds the `top_k` best nodes so far in one forward, with a
        mask that lets each see only the committed tokens, its ancestors and itself, at the position its depth
        gives (the pending token sits at `cached - 1`, so a node of depth d at `cached - 1 + d`)."""
        if spec.paths is not None:
            raise ValueError("a fixed tree of rank paths is for per-depth candidates; a draft model grows its own")
        self._drop_drafts()
        tree = GrowingTree()
        frontier = tree.add_children(-1, self.logits, spec.top_k)
        dtype = self.draft.lm.dtype
        for depth in range(2, spec.depth + 1):
            allowed = tree.feed_mask(frontier, self.cached, self.cache.get_seq_length(), self.device)
            # additive, as every attention implementation of transformers takes a prepared 4D mask
            mask = torch.zeros(allowed.shape, dtype=dtype, device=self.device).masked_fill(
                ~allowed, torch.finfo(dtype).min
            )
            ids = torch.tensor([[tree.tokens[n] for n in frontier]], device=self.device)
            positions = torch.full((1, len(frontier)), self.cached + depth - 2, device=self.device)
            out = self.draft(
                ids, past_key_values=self.cache, use_cache=True, attention_mask=mask[None, None], position_ids=positions
            )
            candidates = []
            for row, node in enumerate(frontier):
                candidates += tree.add_children(node, out.logits[0, row], spec.top_k)
            frontier = sorted(candidates, key=lambda n: -tree.scores[n])[: spec.top_k]
        self._drop_drafts()
        return tree.best(spec.budget)
