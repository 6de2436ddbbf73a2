"""The recipe's `draft:` section for DFlash2: DFlash's, over the target's whole vocabulary, plus its convolutions and
candidate selector."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from speculators_train.families.base import SmallDraft
from speculators_train.families.block.settings import Settings as BlockSettings

WHOLE = 1 << 24  # at least any target's vocabulary: new drafts take all of it


class Settings(BlockSettings):
    small: ClassVar[SmallDraft] = SmallDraft(
        # Over the whole vocabulary every scored slot costs a 49k-row head: 16 blocks a sample keep a step short.
        {
            "block_size": 4,
            "num_layers": 1,
            "mask_token_id": 16,
            "selector_rank": 16,
            "selector_top_k": 8,
            "max_anchors": 16,
        },
        learning_rate=3e-4,
    )
    family: Literal["dflash2"] = "dflash2"  # type: ignore[assignment]
    draft_vocab_size: int = Field(
        WHOLE, gt=0, description="DFlash2 drafts over the target's whole vocabulary (speculators requires it)."
    )
    conv_kernel_size: int = Field(2, ge=1, le=64, description="Causal taps of each convolution over a block's slots.")
    conv_group_size: int = Field(16, ge=1, description="Hidden channels sharing one dynamic kernel.")
    selector_rank: int = Field(256, ge=1, le=4096, description="Rank of the candidate selector's codebooks.")
    selector_top_k: int = Field(16, ge=1, le=1024, description="Candidates per slot the selector reranks.")
    selector_weight: float = Field(1.0, ge=0, description="Weight of the selector's loss (speculators' alpha).")

    formats: ClassVar[dict[str, str]] = {"speculators": "formats:DFlash2Format", "gguf": "gguf:GGUFFormat"}
    vllm_needs_gpu: ClassVar[bool] = True  # vLLM's V1 runner refuses DFlash candidate-head drafts

    @property
    def auxiliary(self) -> tuple[float, float]:
        return (0.0, self.selector_weight)

    def recipe_problems(self, recipe: Any) -> list[str]:
        problems = super().recipe_problems(recipe)
        if self.conv_kernel_size > self.block_size:
            problems.append("draft.conv_kernel_size exceeds draft.block_size")
        if recipe.eval.mode == "tree":
            problems.append("eval.mode 'tree': a DFlash2 slot's selector reads the token chosen before it")
        return problems

    def target_problems(self, target_config: Any) -> list[str]:
        text = target_config.get_text_config()
        problems = super().target_problems(target_config)
        if text.hidden_size % self.conv_group_size:
            problems.append(f"draft.conv_group_size: {self.conv_group_size} does not divide {text.hidden_size}")
        return problems
