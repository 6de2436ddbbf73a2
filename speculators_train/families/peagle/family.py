"""P-EAGLE as a registered family: the EAGLE-3 draft's shape and target states, one forward for every depth, and
the speculators format vLLM serves with parallel drafting."""

from __future__ import annotations

from typing import Any

import torch

from speculators_train.errors import UserError
from speculators_train.families.base import DraftStart
from speculators_train.families.eagle.family import EagleFamily
from speculators_train.families.eagle.model import Eagle3Config
from speculators_train.families.peagle.model import PEagleConfig, PEagleDraft, checked_peagle_config
from speculators_train.families.peagle.objective import PEagleObjective
from speculators_train.families.peagle.proposer import PEagleProposer
from speculators_train.families.peagle.settings import Settings
from speculators_train.families.vocab import default_mask_token_id
from speculators_train.head import TargetHead


class PEagleFamily(EagleFamily):
    name = "peagle"
    settings = Settings
    title = "P-EAGLE draft"
    step_label = "depth"
    draft_type = PEagleDraft
    config_type = PEagleConfig
    config_reader = staticmethod(checked_peagle_config)
    proposer_type = PEagleProposer
    not_saved = ("embed_tokens.weight",)  # the target's, frozen; the trained mask row is `mask_embedding`

    def draft_config(
        self, settings: Settings, target_config: Any, aux_layer_ids: list[int], draft_vocab_size: int
    ) -> PEagleConfig:
        base = Eagle3Config.for_target(
            target_config,
            aux_layer_ids,
            draft_vocab_size,
            settings.norm_before_residual,
            norm_before_fc=settings.norm_before_fc,
        )
        mask_id = default_mask_token_id(target_config) if settings.mask_token_id is None else settings.mask_token_id
        if mask_id >= base.target_vocab_size:
            raise UserError(f"draft.mask_token_id {mask_id}: the target has {base.target_vocab_size} ids")
        return PEagleConfig(**base.to_dict(), mask_token_id=mask_id, depths=settings.depths)

    def new_draft(self, settings: Settings, start: DraftStart) -> PEagleDraft:
        """EAGLE-3's start (vocab from counts; lm_head rows, norm and embedding from the target), the mask row
        starting as the mask id's own embedding, mask_hidden random as speculators starts it."""
        draft = super().new_draft(settings, start)
        with torch.no_grad():
            draft.mask_embedding.copy_(draft.embed_tokens.weight[draft.config.mask_token_id])
        return draft

    def objective(
        self,
        draft: PEagleDraft,
        head: TargetHead,
        settings: Settings,
        depth: int | None = None,
        divergence: str | None = None,
    ) -> PEagleObjective:
        """Scores `depth` depths (at most the draft's) instead of the settings' when given."""
        depths = min(depth or settings.depths, draft.config.depths)
        ratios = (settings.down_sample_ratio, settings.down_sample_ratio_min)
        return PEagleObjective(draft, head, depths, ratios, divergence or settings.loss)

    def max_draft_tokens(self, draft: PEagleDraft) -> int:
        return draft.config.depths

    def card_rows(self, draft: PEagleDraft, fmt: str, k: int) -> list[tuple[str, str]]:
        cfg = draft.config
        return [
            ("target states read", f"{cfg.aux_layer_ids} (the residual stream entering layer k, as vLLM counts)"),
            ("draft vocabulary", f"{cfg.draft_vocab_size} of {cfg.target_vocab_size} target ids"),
            ("speculative tokens", f"{k}, from one draft forward (depths trained: {cfg.depths})"),
            ("mask token id", f"{cfg.mask_token_id} (its embedding row is trained and shipped in embed_tokens)"),
            ("norm_before_residual / norm_before_fc", f"{cfg.norm_before_residual} / {cfg.norm_before_fc}".lower()),
            ("engines", "vLLM (parallel drafting); llama.cpp and SGLang have no P-EAGLE runtime"),
        ]


FAMILY = PEagleFamily()
