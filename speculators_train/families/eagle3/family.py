"""EAGLE-3 as a registered family: the draft reads the target's aux states, trains with training-time test, and
exports for vLLM (speculators format) and SGLang."""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from speculators_train.families.base import Family
from speculators_train.families.eagle3.model import Eagle3Config, Eagle3Draft, checked_config
from speculators_train.families.eagle3.objective import Eagle3Objective
from speculators_train.families.eagle3.proposer import Eagle3Proposer
from speculators_train.families.eagle3.settings import Settings
from speculators_train.families.vocab import build_vocab_mapping, draft_to_target
from speculators_train.target import OFFSET_NORM_TYPES, StateSpec, Target, TargetHead


class Eagle3Family(Family):
    name = "eagle3"
    settings = Settings
    title = "EAGLE-3 draft"
    step_label = "ttt step"
    columns = ("loss", "full_acc", "cond_acc")
    draft_type = Eagle3Draft
    config_type = Eagle3Config
    not_saved = ("embed_tokens.weight",)  # the target's, frozen and large: restored from the target

    def config_from_dict(self, saved: dict[str, Any]) -> Eagle3Config:
        return checked_config(saved)

    def draft_config(
        self, settings: Settings, target_config: Any, aux_layer_ids: list[int], draft_vocab_size: int
    ) -> Eagle3Config:
        """The config of a fresh draft: one decoder layer shaped like the target's."""
        return Eagle3Config.for_target(
            target_config,
            aux_layer_ids,
            draft_vocab_size,
            settings.norm_before_residual,
            norm_before_fc=settings.norm_before_fc,
            norm_output=settings.norm_output,
        )

    def new_draft(
        self,
        settings: Settings,
        target_config: Any,
        head: dict[str, torch.Tensor],
        token_freq: torch.Tensor,
        aux_layer_ids: list[int],
    ) -> Eagle3Draft:
        """Vocab from token counts; the embedding (frozen), lm_head rows and norm start from the target's."""
        d2t, t2d = build_vocab_mapping(token_freq, min(settings.draft_vocab_size, token_freq.numel()))
        draft = self.draft_type(self.draft_config(settings, target_config, aux_layer_ids, d2t.numel()))
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(head["embed"])
            draft.d2t.copy_(d2t)
            draft.t2d.copy_(t2d)
            draft.lm_head.weight.copy_(head["lm_head"][draft_to_target(d2t)])
            # Gemma stores its final norm weight as an offset from 1; the draft's Llama norm multiplies by w.
            offset = 1.0 if target_config.get_text_config().model_type in OFFSET_NORM_TYPES else 0.0
            draft.norm.weight.copy_(head["norm"] + offset)
        return draft

    def states(self, config: Eagle3Config) -> StateSpec:
        return StateSpec(tuple(config.aux_layer_ids))

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

    def objective(
        self,
        draft: Eagle3Draft,
        head: TargetHead,
        settings: Settings,
        depth: int | None = None,
        divergence: str | None = None,
    ) -> Eagle3Objective:
        return Eagle3Objective(
            draft, head, depth or settings.ttt_steps, settings.step_decay, divergence or settings.loss
        )

    def proposer(self, draft: Eagle3Draft, target: Target) -> Eagle3Proposer:
        return Eagle3Proposer(draft)

    def card_rows(self, draft: Eagle3Draft, fmt: str, k: int) -> list[tuple[str, str]]:
        cfg = draft.config
        ids = f"{cfg.aux_layer_ids} (the residual stream entering layer k, as vLLM counts)"
        if fmt == "sglang":
            ids += f"; written as {[i - 1 for i in cfg.aux_layer_ids]} in `eagle_config`, as SGLang counts"
        return [
            ("target states read", ids),
            ("draft vocabulary", f"{cfg.draft_vocab_size} of {cfg.target_vocab_size} target ids"),
            ("speculative tokens", str(k)),
            ("norm_before_residual", str(cfg.norm_before_residual).lower()),
            ("norm_before_fc / norm_output", f"{str(cfg.norm_before_fc).lower()} / {str(cfg.norm_output).lower()}"),
        ]


FAMILY = Eagle3Family()
