"""The registry of draft families: one line each. A family is the folder of that name here, holding
`settings.py` (its recipe section, `Settings`) and `family.py` (`FAMILY`, everything else); see `base.py`."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from speculators_train.errors import UserError

if TYPE_CHECKING:
    from speculators_train.families.base import Family, FamilySettings

FAMILIES = (
    "eagle3",  # EAGLE-3: fused target states + one decoder layer, trained with training-time test (the default)
    "medusa",  # Medusa-1: heads over the target's last hidden state
    "peagle",  # P-EAGLE: an EAGLE-3-shaped draft proposing every draft token in one forward
    "mlp",  # the MLP speculator: stages over the target's last state, each fed the token drafted before it
    "dflash",  # DFlash: a block of draft tokens from one forward over [anchor, masks], target states as context
    "dspark",  # DSpark: DFlash with every slot proposing, a Markov head on the token before, a confidence head
    "dflash2",  # DFlash2: DFlash with convolutions across a block's slots and a top-k candidate selector
    "mtp",  # an MTP head: one decoder layer of the target's class over its last state and the next token
    "draft_model",  # a standalone small causal LM with the target's tokenizer (last: its format is a plain folder)
)


def settings_types() -> tuple[type[FamilySettings], ...]:
    """Every family's recipe section (cheap: no torch), for the recipe's `draft:` union."""
    return tuple(import_module(f"{__name__}.{name}.settings").Settings for name in FAMILIES)


def get(name: str) -> Family:
    if name not in FAMILIES:
        raise UserError(f"unknown draft family {name!r} (registered: {', '.join(FAMILIES)})")
    return import_module(f"{__name__}.{name}.family").FAMILY


def all_families() -> list[Family]:
    return [get(name) for name in FAMILIES]
