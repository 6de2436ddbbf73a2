"""The DFlash2 draft as a proposer: one forward over [anchor, mask x k], then a greedy walk over each slot's top-k
candidates, each scored by its transition from the token chosen before it (the anchor before the first), as vLLM's
DFlash2 speculator walks them."""

from __future__ import annotations

import torch

from speculators_train.families.block.proposer import DFlashProposer
from speculators_train.families.dflash2.model import DFlash2Draft
from speculators_train.proposal import DraftTree, Sampling, TreeSpec


class DFlash2Proposer(DFlashProposer):
    draft: DFlash2Draft

    @torch.inference_mode()
    def propose_chain(
        self, k: int, sampling: Sampling, generator: torch.Generator | None
    ) -> tuple[list[int], torch.Tensor | None]:
        """Each slot's best candidate, or (`sampling.samples_drafts`) a sample of softmax(scores / T) over its
        candidates: the q the rejection rule needs (zero off the candidates)."""
        draft = self.draft
        normed = self.outputs(k, logits=False)
        logits = draft.lm_head(normed).float()
        selector = draft.candidate_selector
        previous = torch.tensor(self.anchor, device=self.device)
        tokens: list[int] = []
        rows = torch.zeros(k, draft.config.target_vocab_size, device=self.device)
        for i in range(k):
            candidates = logits[i].topk(selector.top_k).indices
            scores = selector.scores(logits[i], normed[i].float(), previous, candidates).float()
            if sampling.samples_drafts:
                q = torch.softmax(scores / sampling.temperature, dim=-1)
                pick = int(torch.multinomial(q, 1, generator=generator))
                rows[i, self.targets[candidates]] = q
            else:
                pick = int(scores.argmax())
            previous = self.targets[candidates[pick]]
            tokens.append(int(previous))
        return tokens, rows if sampling.samples_drafts else None

    def propose_tree(self, spec: TreeSpec) -> DraftTree:
        raise ValueError("a DFlash2 slot's selector reads the token chosen before it: verify chains")
