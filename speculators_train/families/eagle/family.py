"""What EAGLE-3 and P-EAGLE drafts share as families: a fresh draft starts from the target's head with a reduced
vocabulary, reads the aux states its config names, takes the target's embedding, and keeps RoPE in fp32."""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from speculators_train.families.base import DraftStart, Family, FamilySettings
from speculators_train.families.eagle.model import Eagle3Config, Eagle3Draft
from speculators_train.families.vocab import build_vocab_mapping, draft_to_target
from speculators_train.head import head_norm_offset


class EagleFamily(Family):
    """A family whose draft is an `Eagle3Draft` (or extends it); subclasses say how its config is built."""

    @abstractmethod
    def draft_config(
        self, settings: FamilySettings, target_config: Any, aux_layer_ids: list[int], draft_vocab_size: int
    ) -> Eagle3Config:
        """The config of a fresh draft for this target."""

    def new_draft(self, settings: FamilySettings, start: DraftStart) -> Eagle3Draft:
        """Vocab from token counts; the embedding (frozen), lm_head rows and norm start from the target's."""
        freq, head, target_config = start.token_freq, start.head, start.target_config
        d2t, t2d = build_vocab_mapping(freq, min(settings.draft_vocab_size, freq.numel()))
        draft = self.draft_type(self.draft_config(settings, target_config, start.aux_layer_ids, d2t.numel()))
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(head["embed"])
            draft.d2t.copy_(d2t)
            draft.t2d.copy_(t2d)
            draft.lm_head.weight.copy_(head["lm_head"][draft_to_target(d2t)])
            # Gemma stores its final norm weight as an offset from 1; the draft's Llama norm multiplies by w.
            draft.norm.weight.copy_(head["norm"] + head_norm_offset(target_config))
        return draft

    def attach_target(self, draft: Eagle3Draft, embed_weight: torch.Tensor, has_embedding: bool) -> None:
        """The target's embedding, unless the draft's files carried their own (vLLM keeps those too)."""
        if not has_embedding:
            with torch.no_grad():
                draft.embed_tokens.weight.copy_(embed_weight)

    def place(self, draft: Eagle3Draft, device: torch.device, dtype: torch.dtype) -> Eagle3Draft:
        draft = draft.to(device=device, dtype=dtype).eval()
        # `.to(dtype)` also rounds RoPE's inv_freq buffer; rebuild it in fp32 as training and engines keep it.
        draft.rotary_emb = LlamaRotaryEmbedding(draft.config.llama).to(device)
        return draft
