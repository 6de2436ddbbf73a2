"""The DSpark draft as a proposer: one backbone forward over [anchor, mask x (k - 1)], then the slots in order,
each biased by the Markov head on the token drafted before it (the anchor before slot 0), as vLLM and llama.cpp
chain them. With `sampling.p_min` > 0 the chain stops before the first slot whose confidence head predicts an
acceptance below it (llama.cpp's `--spec-draft-p-min` for DSpark)."""

from __future__ import annotations

import torch

from speculators_train.families.block.proposer import DFlashProposer
from speculators_train.families.dspark.model import DSparkDraft
from speculators_train.proposal import DraftTree, Sampling, TreeSpec


class DSparkProposer(DFlashProposer):
    draft: DSparkDraft

    @torch.inference_mode()
    def propose_chain(
        self, k: int, sampling: Sampling, generator: torch.Generator | None
    ) -> tuple[list[int], torch.Tensor | None]:
        """Each slot's argmax, or (`sampling.samples_drafts`) a sample of its softmax(logits / T) given the tokens
        drawn before it: the q the rejection rule needs."""
        draft = self.draft
        normed = self.outputs(k, logits=False)  # [k, H]
        base = draft.lm_head(normed).float()
        previous = torch.tensor([self.anchor], device=self.device)
        state = None if draft.markov_head is None else draft.markov_head.start(draft.markov_head.markov_w1(previous))
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for i in range(k):
            if sampling.p_min > 0 and draft.predicts_acceptance:
                confidence = torch.sigmoid(draft.confidence_logits(normed[i : i + 1], previous).float())
                if float(confidence) < sampling.p_min:
                    break
            logits = base[i]
            if draft.markov_head is not None:
                bias, state = draft.markov_head.step(draft.markov_head.markov_w1(previous), normed[i : i + 1], state)
                logits = logits + bias[0].float()
            if sampling.samples_drafts:
                q = torch.softmax(logits / sampling.temperature, dim=-1)
                pick = int(torch.multinomial(q, 1, generator=generator))
                rows.append(q)
            else:
                pick = int(logits.argmax())
            tokens.append(int(self.targets[pick]))
            previous = self.targets[pick : pick + 1]
        if not sampling.samples_drafts:
            return tokens, None
        q_target = torch.zeros(len(rows), draft.config.target_vocab_size, device=self.device)
        if rows:
            q_target[:, self.targets] = torch.stack(rows)
        return tokens, q_target

    def propose_tree(self, spec: TreeSpec) -> DraftTree:
        raise ValueError("a DSpark slot reads the token drafted before it: verify chains (eval.mode: chain)")
