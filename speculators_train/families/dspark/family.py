"""DSpark as a registered family: DFlash's backbone, data and start, with every slot proposing, the Markov and
confidence heads, and the speculators format vLLM serves as `method: dspark` (llama.cpp: `draft-dspark`).

Its own family rather than DFlash options: the recipe's `family`, speculators' `speculators_model_type`, vLLM's
method and llama.cpp's spec type all name it `dspark`, and its slots, proposer and files differ from DFlash's."""

from __future__ import annotations

from typing import Any

from speculators_train.families.block.family import DFlashFamily
from speculators_train.families.dspark.model import DSparkConfig, DSparkDraft, checked_dspark_config
from speculators_train.families.dspark.proposer import DSparkProposer
from speculators_train.families.dspark.settings import Settings


class DSparkFamily(DFlashFamily):
    """A fresh draft starts as DFlash's; the Markov head starts near zero, so the backbone's logits lead."""

    name = "dspark"
    settings = Settings
    title = "DSpark draft"
    draft_type = DSparkDraft
    config_type = DSparkConfig
    config_reader = staticmethod(checked_dspark_config)
    proposer_type = DSparkProposer

    def draft_config(
        self, settings: Settings, target_config: Any, aux_layer_ids: list[int], draft_vocab_size: int
    ) -> DSparkConfig:
        base = super().draft_config(settings, target_config, aux_layer_ids, draft_vocab_size)
        return DSparkConfig.with_heads(base, settings)

    def max_draft_tokens(self, draft: DSparkDraft) -> int:
        return draft.config.block_size

    def card_rows(self, draft: DSparkDraft, fmt: str, k: int) -> list[tuple[str, str]]:
        cfg = draft.config
        rows = super().card_rows(draft, fmt, k)[:4]
        rows[2] = ("block", f"{cfg.block_size} slots: the anchor (the target's last token) and masks, each proposing")
        markov = f"rank {cfg.markov_rank}, {cfg.markov_head_type}" if cfg.markov_rank else "none"
        return [
            *rows,
            ("Markov head", f"{markov}: each slot's logits biased by the token before it"),
            ("confidence head", "predicts each slot's acceptance" if cfg.confidence_head else "none"),
            ("speculative tokens", f"{k}, from one draft forward and a chain over the slots"),
            ("mask token id", f"{cfg.mask_token_id} (the target's embedding row of it)"),
            ("engines", "vLLM (`method: dspark`, its V2 model runner); llama.cpp (`--spec-type draft-dspark`)"),
        ]


FAMILY = DSparkFamily()
