"""EAGLE-3 as a registered family: the draft reads the target's aux states, trains with training-time test, and
exports for vLLM (speculators format) and SGLang."""

from __future__ import annotations

from typing import Any

from speculators_train.families.eagle.family import EagleFamily
from speculators_train.families.eagle.model import Eagle3Config, Eagle3Draft, checked_config
from speculators_train.families.eagle3.objective import Eagle3Objective
from speculators_train.families.eagle3.proposer import Eagle3Proposer
from speculators_train.families.eagle3.settings import Settings
from speculators_train.head import TargetHead


class Eagle3Family(EagleFamily):
    name = "eagle3"
    settings = Settings
    title = "EAGLE-3 draft"
    step_label = "ttt step"
    draft_type = Eagle3Draft
    config_type = Eagle3Config
    config_reader = staticmethod(checked_config)
    proposer_type = Eagle3Proposer
    not_saved = ("embed_tokens.weight",)  # the target's, frozen and large: restored from the target

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
