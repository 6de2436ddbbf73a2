"""DFlash2 as a registered family: DFlash's backbone (`families/block/`) over the target's whole vocabulary, with
convolutions across a block's slots and a candidate selector; the speculators format vLLM serves as `method: dflash`
with the `DFlash2DraftModel` architecture."""

from __future__ import annotations

from typing import Any

from speculators_train.families.block.family import DFlashFamily
from speculators_train.families.dflash2.model import OPTIONS, DFlash2Config, DFlash2Draft, checked_dflash2_config
from speculators_train.families.dflash2.proposer import DFlash2Proposer
from speculators_train.families.dflash2.settings import Settings


class DFlash2Family(DFlashFamily):
    name = "dflash2"
    settings = Settings
    title = "DFlash2 draft"
    draft_type = DFlash2Draft
    config_type = DFlash2Config
    config_reader = staticmethod(checked_dflash2_config)
    proposer_type = DFlash2Proposer

    def draft_config(
        self, settings: Settings, target_config: Any, aux_layer_ids: list[int], draft_vocab_size: int
    ) -> DFlash2Config:
        base = super().draft_config(settings, target_config, aux_layer_ids, draft_vocab_size)
        return DFlash2Config(**base.to_dict(), **{name: getattr(settings, name) for name in OPTIONS})


FAMILY = DFlash2Family()
