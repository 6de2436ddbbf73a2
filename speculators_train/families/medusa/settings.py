"""The recipe's `draft:` section for Medusa heads."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from speculators_train.families.base import FamilySettings, SmallDraft, TargetStates

# Caps a recipe and a Medusa file are held to: head h predicts the token h + 2 ahead, and the published heads
# number 3 to 5 with 1 block each. A file's shared lm_head (`original_lm_head`) is copied once per head, so the
# head count also bounds what a loaded file can make this process allocate.
MAX_HEADS = 16
MAX_BLOCKS = 16


class Settings(FamilySettings):
    small: ClassVar[SmallDraft] = SmallDraft({"num_heads": 3, "draft_vocab_size": 512})
    family: Literal["medusa"] = "medusa"
    num_heads: int = Field(4, gt=0, le=MAX_HEADS, description="Head h predicts token t+2+h.")
    num_layers: int = Field(1, gt=0, le=MAX_BLOCKS, description="Residual blocks x + SiLU(Wx + b) per head.")
    loss: Literal["soft", "hard"] = Field("soft", description="soft: distil the target's distribution; hard: labels.")
    head_decay: float = Field(0.8, gt=0, le=1, description="Loss weight of head h is head_decay**h.")
    draft_vocab_size: int = Field(8192, gt=0, description="Reduced vocab from the generator's token counts.")

    formats: ClassVar[dict[str, str]] = {"speculators": "formats:MedusaFormat"}  # SGLang has no Medusa speculator
    tree_shapes: ClassVar[tuple[str, ...]] = ("dynamic", "measured")
    fine_tunes: ClassVar[bool] = False
    target_states: ClassVar[TargetStates] = "final"  # heads over the last state: no aux layers
