"""An MLP speculator as a proposer: K stages run one after another, each fed the token the one before drafted."""

from __future__ import annotations

import torch
from torch import nn

from speculators_train.families.mlp.model import MLPDraft
from speculators_train.proposal import DraftTree, Sampling, TreeSpec
from speculators_train.target import StateSpec


class MLPProposer:
    """Reads the target's post-norm state at the last committed position and the token committed after it (the
    pending one); no cache: a proposal starts from those two alone."""

    def __init__(self, draft: MLPDraft, final_norm: nn.Module, states: StateSpec) -> None:
        self.states = states
        self.draft = draft.eval()
        self.final_norm = final_norm
        self.device = next(draft.parameters()).device
        self.reset()

    def reset(self, first: int | None = None) -> None:
        self.state: torch.Tensor | None = None
        self.token: int | None = None

    @torch.inference_mode()
    def extend(self, tokens: list[int], states: torch.Tensor) -> None:
        """`tokens[j]` follows the position of `states[j]`, as the loop pairs them."""
        last = states[-1].to(self.device, self.draft.head[0].weight.dtype)
        self.state, self.token = self.final_norm(last), tokens[-1]

    @torch.inference_mode()
    def propose_chain(
        self, k: int, sampling: Sampling, generator: torch.Generator | None
    ) -> tuple[list[int], torch.Tensor | None]:
        """Each stage's argmax or (`sampling.samples_drafts`) a sample of softmax(logits / T), fed to the next stage;
        the sampled stages' distributions are the q the rejection rule needs."""
        if k > self.draft.config.n_predict:
            raise ValueError(f"{k} draft tokens asked of an MLP speculator with {self.draft.config.n_predict} stages")
        state, token = self.draft.start(self.state), self.token
        drafts, qs = [], []
        for i in range(k):
            state, logits = self.draft.stage(i, state, torch.tensor(token, device=self.device))
            logits = logits.float()
            if sampling.samples_drafts:
                q = torch.softmax(logits / sampling.temperature, dim=-1)
                token = int(torch.multinomial(q, 1, generator=generator))
                qs.append(q)
            else:
                token = int(logits.argmax())
            drafts.append(token)
        return drafts, torch.stack(qs) if qs else None

    def propose_tree(self, spec: TreeSpec) -> DraftTree:
        raise NotImplementedError("an MLP speculator drafts chains here (the recipe refuses eval.mode tree)")
