"""The recipe's `draft:` section for DFlash (`families/block/settings.py`)."""

from speculators_train.families.block.settings import Settings

__all__ = ["Settings"]
