"""DFlash as a registered family: Qwen3 layers over [anchor, mask x (B - 1)] with the target's fused states as
context keys, one forward per block, and the speculators format vLLM serves as `method: dflash`."""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from speculators_train.errors import UserError
from speculators_train.families.block.model import DFlashConfig, DFlashDraft, checked_dflash_config
from speculators_train.families.block.objective import DFlashObjective
from speculators_train.families.block.proposer import DFlashProposer
from speculators_train.families.block.settings import Settings
from speculators_train.families.eagle.family import EagleFamily
from speculators_train.families.vocab import default_mask_token_id
from speculators_train.head import TargetHead


class DFlashFamily(EagleFamily):
    """A fresh draft starts as EAGLE-3's does (reduced vocabulary from counts, lm_head rows and final norm from the
    target, the target's embedding frozen); its layers start at random."""

    name = "dflash"
    settings = Settings
    title = "DFlash draft"
    step_label = "position"
    draft_type = DFlashDraft
    config_type = DFlashConfig
    config_reader = staticmethod(checked_dflash_config)
    proposer_type = DFlashProposer
    not_saved = ("embed_tokens.weight",)

    def draft_config(
        self, settings: Settings, target_config: Any, aux_layer_ids: list[int], draft_vocab_size: int
    ) -> DFlashConfig:
        mask_id = default_mask_token_id(target_config) if settings.mask_token_id is None else settings.mask_token_id
        vocab = target_config.get_text_config().vocab_size
        if mask_id >= vocab:
            raise UserError(f"draft.mask_token_id {mask_id}: the target has {vocab} ids")
        return DFlashConfig.for_target(
            target_config, aux_layer_ids, draft_vocab_size, settings.block_size, settings.num_layers, mask_id
        )

    def place(self, draft: DFlashDraft, device: torch.device, dtype: torch.dtype) -> DFlashDraft:
        draft = draft.to(device=device, dtype=dtype).eval()
        # `.to(dtype)` also rounds RoPE's inv_freq buffer; rebuild it in fp32 as training and engines keep it.
        draft.rotary_emb = Qwen3RotaryEmbedding(draft.config.qwen3).to(device)
        return draft

    def objective(
        self,
        draft: DFlashDraft,
        head: TargetHead,
        settings: Settings,
        depth: int | None = None,
        divergence: str | None = None,
    ) -> DFlashObjective:
        """Scores the first `depth` proposing slots (at most the block's) instead of all of them when given; the
        block keeps its trained size."""
        slots = self.max_draft_tokens(draft)
        weighting = (settings.position_weight, settings.gamma, settings.dpace_alpha)
        kind = divergence or settings.loss
        if kind != "ce" and weighting[0] == "dpace":  # D-PACE reads confidence from a cross-entropy
            weighting = ("exp_decay", settings.gamma, settings.dpace_alpha)
        positions = min(depth or slots, slots)
        return DFlashObjective(draft, head, positions, weighting, settings.max_anchors, kind, settings.auxiliary)

    def max_draft_tokens(self, draft: DFlashDraft) -> int:
        return draft.config.block_size - 1

    def card_rows(self, draft: DFlashDraft, fmt: str, k: int) -> list[tuple[str, str]]:
        cfg = draft.config
        return [
            ("target states read", f"{cfg.aux_layer_ids} (the residual stream entering layer k, as vLLM counts)"),
            ("draft layers", f"{cfg.qwen3.num_hidden_layers} Qwen3 decoder layers, bidirectional within a block"),
            ("block", f"{cfg.block_size} slots: the anchor (the target's last token) and {cfg.block_size - 1} masks"),
            ("draft vocabulary", f"{cfg.draft_vocab_size} of {cfg.target_vocab_size} target ids"),
            ("speculative tokens", f"{k}, from one draft forward"),
            ("mask token id", f"{cfg.mask_token_id} (the target's embedding row of it)"),
            ("engines", "vLLM (`method: dflash`); llama.cpp (`--spec-type draft-dflash`) from `export --format gguf`"),
        ]


FAMILY = DFlashFamily()
