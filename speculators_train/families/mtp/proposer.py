"""The MTP head as a proposer: its own key/value cache of the verified positions' step-0 inputs, rolled back to the
committed positions before every proposal; drafting feeds each step's output and token back at the next position,
as vLLM's MTP proposer does."""

from __future__ import annotations

import torch
from torch import nn
from transformers import DynamicCache

from speculators_train.families.mtp.model import MTPDraft
from speculators_train.proposal import DraftTree, Sampling, TreeSpec
from speculators_train.target import StateSpec


class MTPProposer:
    """The pair (h_p, x_{p+1}) sits at position p: the target's post-norm state after x_p and the token after it."""

    def __init__(self, draft: MTPDraft, final_norm: nn.Module, states: StateSpec) -> None:
        self.states = states
        self.draft = draft.eval()
        self.final_norm = final_norm
        self.device = next(draft.parameters()).device
        self.reset()

    def reset(self, first: int | None = None) -> None:
        self.cache = DynamicCache()
        self.committed = 0  # pairs at positions 0 .. committed - 1 are in the cache
        self.out: torch.Tensor | None = None  # the head's output at the last committed position [1, 1, H]
        self.logits: torch.Tensor | None = None  # its logits [V]

    def _rollback(self) -> None:
        """Drop the cached drafted positions: back to the committed ones."""
        extra = self.cache.get_seq_length() - self.committed
        if extra > 0:
            self.cache.crop(-extra)

    def _step(self, tokens: torch.Tensor, hidden: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(start, start + tokens.shape[0], device=self.device)[None]
        out = self.draft.step(hidden, tokens[None], positions, self.cache)
        return out, self.draft.logits(out[:, -1]).float()[0]

    @torch.inference_mode()
    def extend(self, tokens: list[int], states: torch.Tensor) -> None:
        """`tokens[j]` follows the position of `states[j]` (pre-norm final states), as the loop pairs them."""
        self._rollback()
        dtype = self.draft.eh_proj.weight.dtype
        hidden = self.final_norm(states.to(self.device, self.final_norm.weight.dtype)).to(dtype)[None]
        ids = torch.tensor(tokens, device=self.device)
        self.out, self.logits = self._step(ids, hidden, self.committed)
        self.out = self.out[:, -1:]
        self.committed += len(tokens)

    @torch.inference_mode()
    def propose_chain(
        self, k: int, sampling: Sampling, generator: torch.Generator | None
    ) -> tuple[list[int], torch.Tensor | None]:
        """k tokens, each the head's argmax or (`sampling.samples_drafts`) a sample of softmax(logits / T), with
        the distributions [k, V] the rejection rule needs."""
        self._rollback()
        out, logits = self.out, self.logits
        tokens: list[int] = []
        qs = []
        for i in range(k):
            if sampling.samples_drafts:
                q = torch.softmax(logits / sampling.temperature, dim=-1)
                choice = torch.multinomial(q, 1, generator=generator)
                qs.append(q)
            else:
                choice = logits.argmax()[None]
            tokens.append(int(choice))
            if i < k - 1:
                out, logits = self._step(choice, self.draft.carry(out), self.committed + i)
        return tokens, torch.stack(qs) if qs else None

    def propose_tree(self, spec: TreeSpec) -> DraftTree:
        raise NotImplementedError("an MTP head drafts chains here (the recipe refuses eval.mode tree)")
