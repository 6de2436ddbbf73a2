"""The recipe's `draft:` section for DFlash."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from speculators_train.families.base import Divergence, FamilySettings, SmallDraft

MAX_BLOCK = 64  # a block's slots (anchor + masks); a config past it is refused when read
MAX_DRAFT_LAYERS = 64


class Settings(FamilySettings):
    small: ClassVar[SmallDraft] = SmallDraft(
        {"block_size": 4, "num_layers": 1, "mask_token_id": 16, "draft_vocab_size": 512},
        learning_rate=3e-4,  # at 3e-3 a fresh draft settles on one token for every slot (docs/families.md)
    )
    family: Literal["dflash"] = "dflash"
    draft_vocab_size: int = Field(8192, gt=0, description="Reduced vocab from the generator's token counts.")
    block_size: int = Field(
        16, ge=2, le=MAX_BLOCK, description="Slots of a block: the anchor and block_size - 1 mask slots it drafts."
    )
    num_layers: int = Field(5, ge=1, le=MAX_DRAFT_LAYERS, description="Qwen3 decoder layers of the draft.")
    mask_token_id: int | None = Field(
        None,
        ge=0,
        description="Input id of the mask slots (their embedding is the target's row of it, frozen); default: the "
        "target's pad, else eos, else 0, as speculators falls back.",
    )
    position_weight: Literal["exp_decay", "dpace"] = Field(
        "dpace",
        description="Loss weight of block position i: exp(-(i - 1) / gamma), or D-PACE's from the draft's own "
        "confidence in the positions before i.",
    )
    gamma: float = Field(4.0, gt=0, description="exp_decay's scale: larger keeps later positions' weight up.")
    dpace_alpha: float = Field(0.5, gt=0, le=1, description="D-PACE's smoothing of the confidence.")
    max_anchors: int = Field(512, gt=0, description="Blocks trained per sample, drawn from its assistant tokens.")
    loss: Divergence = Field("ce", description="ce (soft cross-entropy, DFlash's) or another divergence.")

    formats: ClassVar[dict[str, str]] = {"speculators": "formats:DFlashFormat", "gguf": "gguf:GGUFFormat"}
    own_attention: ClassVar[bool] = True  # Llama/Qwen3 decoder layers of its own

    @property
    def auxiliary(self) -> tuple[float, float]:
        """The weights of the draft's own terms beside the divergence: (confidence BCE, candidate selector CE)."""
        return (0.0, 0.0)

    def recipe_problems(self, recipe: Any) -> list[str]:
        problems = []
        if recipe.data.max_length <= self.block_size:
            problems.append(f"data.max_length ({recipe.data.max_length}) must exceed draft.block_size")
        if self.position_weight == "dpace" and self.loss != "ce":
            problems.append(
                f"draft.position_weight 'dpace' reads the draft's confidence from its cross-entropy; with draft.loss "
                f"{self.loss!r} use position_weight 'exp_decay' or loss 'ce'"
            )
        return problems
