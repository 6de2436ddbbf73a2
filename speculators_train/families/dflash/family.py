"""DFlash as a registered family (`families/block/`: its backbone, objective, proposer and files)."""

from speculators_train.families.block.family import DFlashFamily

FAMILY = DFlashFamily()
