"""The DFlash draft as a proposer: one draft forward per verify step over [anchor, mask x k], as vLLM's DFlash
proposer runs it. The context keys of every verified state are computed once, when the state arrives, and kept;
the block's own keys are never kept. Chains take each slot's argmax (or a sample of its softmax); trees take the
most probable paths of the per-slot top-k candidates (no slot reads another's draft token)."""

from __future__ import annotations

import torch

from speculators_train.families.block.model import KV, DFlashDraft
from speculators_train.families.vocab import draft_to_target
from speculators_train.proposal import DraftTree, Sampling, TreeSpec, independent_chain, independent_tree
from speculators_train.target import StateSpec


class DFlashProposer:
    """State g_t sits at position t; the anchor is the last token `extend` gave (the bonus token, whose state the
    target has not computed yet), at the position after the last state. A block of k + 1 slots proposes k tokens:
    vLLM sizes the block by the draft tokens asked, not by the block size trained."""

    def __init__(self, draft: DFlashDraft, states: StateSpec) -> None:
        self.states = states
        self.draft = draft.eval()
        self.device = next(draft.parameters()).device
        self.targets = draft_to_target(draft.d2t.to(self.device))
        self.reset()

    def reset(self, first: int | None = None) -> None:
        self.context: list[KV] = []  # per layer: keys and values of every state so far [1, kv heads, L, d]
        self.length = 0  # states in the context
        self.queued: list[torch.Tensor] = []
        self.anchor: int | None = None

    def extend(self, tokens: list[int], states: torch.Tensor) -> None:
        self.queued.append(states)
        if tokens:
            self.anchor = tokens[-1]

    def logits(self, k: int) -> torch.Tensor:
        """[k, draft vocab]: the proposing slots of one block at the anchor (k + 1 slots: the anchor proposes
        nothing)."""
        return self.outputs(k, logits=True)

    @torch.inference_mode()
    def outputs(self, k: int, logits: bool) -> torch.Tensor:
        """The k proposing slots of one block at the anchor: their logits [k, D], or their normed outputs [k, H]."""
        if self.anchor is None:
            raise RuntimeError("propose before any extend")
        draft = self.draft
        if self.queued:
            states = torch.cat(self.queued).to(self.device, draft.fc.weight.dtype)[None]
            positions = torch.arange(self.length, self.length + states.shape[1], device=self.device)[None]
            new = draft.context(states, positions)
            if self.context:
                new = [
                    (torch.cat([k0, k1], -2), torch.cat([v0, v1], -2))
                    for (k0, v0), (k1, v1) in zip(self.context, new, strict=True)
                ]
            self.context = new
            self.length += states.shape[1]
            self.queued = []
        anchor = torch.tensor([[self.anchor]], device=self.device)
        at = torch.tensor([[self.length]], device=self.device)
        return draft.blocks(anchor, at, k + draft.first_slot, self.context, None, logits=logits)[0, 0]

    def propose_chain(
        self, k: int, sampling: Sampling, generator: torch.Generator | None
    ) -> tuple[list[int], torch.Tensor | None]:
        """Each slot's argmax, or (`sampling.samples_drafts`) a sample of its softmax(logits / T): every slot's
        distribution is fixed before any draw, so it is the q the rejection rule needs."""
        vocab = self.draft.config.target_vocab_size
        return independent_chain(self.logits(k).float(), self.targets, vocab, sampling, generator)

    def propose_tree(self, spec: TreeSpec) -> DraftTree:
        """The `budget` most probable paths over the per-slot top-k candidates of one forward."""
        if spec.paths is not None:
            raise ValueError("DFlash grows dynamic trees only")
        return independent_tree(self.logits(spec.depth).float(), self.targets, spec.top_k, spec.budget, None)
