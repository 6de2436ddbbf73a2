"""The P-EAGLE draft as a proposer: one draft forward per verify step, over the newly committed pairs and K - 1
mask slots after them, as vLLM's parallel drafting runs it. Chains take each depth's argmax (or a sample of its
softmax); trees take the most probable paths of the per-depth top-k candidates."""

from __future__ import annotations

import torch

from speculators_train.families.eagle.model import DraftCache
from speculators_train.families.peagle.model import PEagleDraft
from speculators_train.families.vocab import draft_to_target
from speculators_train.proposal import DraftTree, Sampling, TreeSpec, independent_chain, independent_tree
from speculators_train.target import StateSpec


class PEagleProposer:
    """The draft with its KV cache of committed pairs; positions follow training (the pair (x_{j+1}, g_j) at RoPE
    position j+1, mask slot d after the last pair at j+1+d). `extend` only queues the pairs: the next proposal
    feeds them and its mask slots in the same forward, then drops the mask slots' keys."""

    def __init__(self, draft: PEagleDraft, states: StateSpec) -> None:
        self.states = states
        self.draft = draft.eval()
        self.device = next(draft.parameters()).device
        self.targets = draft_to_target(draft.d2t.to(self.device))
        self.reset()

    def reset(self, first: int | None = None) -> None:
        self.cache = DraftCache()
        self.committed = 0  # pairs whose keys are in the cache
        self.tokens: list[int] = []  # queued pairs, fed by the next proposal
        self.queued: list[torch.Tensor] = []
        self.first: torch.Tensor | None = None  # depth-0 logits at the last committed pair [D]

    def extend(self, tokens: list[int], states: torch.Tensor) -> None:
        self.tokens += tokens
        self.queued.append(states)

    @torch.inference_mode()
    def logits(self, k: int) -> torch.Tensor:
        """[k, draft vocab]: depth 0 at the last pair, then the k - 1 mask slots."""
        draft = self.draft
        dtype = draft.fc.weight.dtype
        m, masks = len(self.tokens), k - 1
        if not m and self.first is None:
            raise RuntimeError("propose before any extend")
        parts_e, parts_h = [], []
        if m:
            states = torch.cat(self.queued).to(self.device, dtype)
            parts_e.append(draft.embed(torch.tensor(self.tokens, device=self.device))[None].to(dtype))
            parts_h.append(draft.fuse(states[None]))
        if masks:
            embeds, hidden = draft.mask_inputs(masks, 1, dtype)
            parts_e.append(embeds)
            parts_h.append(hidden)
        if not parts_e:  # k = 1 and nothing new: the last pair's logits stand
            return self.first[None]
        embeds, hidden = torch.cat(parts_e, 1), torch.cat(parts_h, 1)
        new = m + masks
        positions = torch.arange(self.committed + 1, self.committed + 1 + new, device=self.device)[None]
        cached = len(self.cache)
        allowed = torch.ones(new, cached + new, dtype=torch.bool, device=self.device)
        allowed[:, cached:] = torch.ones(new, new, dtype=torch.bool, device=self.device).tril()
        cos, sin = draft.rotary_emb(hidden, positions)
        out = draft.layers[0].decode(embeds, hidden, cos, sin, self.cache, allowed)
        _, logits = draft._outputs(out)
        if m:
            self.first = logits[0, m - 1]
            self.committed += m
            self.tokens, self.queued = [], []
        self.cache.crop(self.committed)  # the mask slots' keys belong to this proposal only
        return torch.cat([self.first[None], logits[0, m:]])

    def propose_chain(
        self, k: int, sampling: Sampling, generator: torch.Generator | None
    ) -> tuple[list[int], torch.Tensor | None]:
        """Each depth's argmax, or (`sampling.samples_drafts`) a sample of its softmax(logits / T): no depth reads
        another's draft token, so each distribution is fixed before any draw and is the q the rejection rule
        needs."""
        vocab = self.draft.config.target_vocab_size
        return independent_chain(self.logits(k).float(), self.targets, vocab, sampling, generator)

    def propose_tree(self, spec: TreeSpec) -> DraftTree:
        """The `budget` most probable paths over the per-depth top-k candidates of one forward (a path's
        probability is the product of its depths', as the depths read no draft token)."""
        if spec.paths is not None:
            raise ValueError("P-EAGLE grows dynamic trees only")
        return independent_tree(self.logits(spec.depth).float(), self.targets, spec.top_k, spec.budget, None)
