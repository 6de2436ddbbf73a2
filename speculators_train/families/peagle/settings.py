"""The recipe's `draft:` section for P-EAGLE."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from speculators_train.families.base import Divergence, FamilySettings, SmallDraft

MAX_DEPTHS = 64  # draft tokens one forward may propose; a config past it is refused when read


class Settings(FamilySettings):
    small: ClassVar[SmallDraft] = SmallDraft({"depths": 4, "mask_token_id": 16, "draft_vocab_size": 512})
    family: Literal["peagle"] = "peagle"
    draft_vocab_size: int = Field(8192, gt=0, description="Reduced vocab from the generator's token counts.")
    depths: int = Field(
        8, gt=0, le=MAX_DEPTHS, description="Depths trained: the most draft tokens one forward proposes well."
    )
    down_sample_ratio: float = Field(
        0.7, gt=0, le=1, description="COD sampling: depth d trains on about max(r**d, r_min) of the positions."
    )
    down_sample_ratio_min: float = Field(0.2, gt=0, le=1, description="The floor r_min of that share.")
    mask_token_id: int | None = Field(
        None,
        ge=0,
        description="Input id of the mask slots (its embedding row is trained); default: the target's pad, else "
        "eos, else 0, as speculators falls back.",
    )
    norm_before_residual: bool = Field(False, description="As EAGLE-3's.")
    norm_before_fc: bool = Field(False, description="EAGLE-3.1: RMSNorm over the concatenated target states before fc.")
    loss: Divergence = Field("forward_kl", description="The paper's KL(target || draft), or another divergence.")

    # vLLM only: SGLang and llama.cpp run no P-EAGLE
    formats: ClassVar[dict[str, str]] = {"speculators": "formats:PEagleFormat"}
    own_attention: ClassVar[bool] = True  # Llama/Qwen3 decoder layers of its own

    def recipe_problems(self, recipe: Any) -> list[str]:
        problems = []
        if recipe.data.max_length <= self.depths + 1:
            problems.append(f"data.max_length ({recipe.data.max_length}) must exceed draft.depths + 1")
        ids = recipe.target.aux_layer_ids
        if ids is not None and len(ids) != 3:
            problems.append(
                f"target.aux_layer_ids {ids}: a P-EAGLE draft reads exactly 3 target states (vLLM builds its fc "
                "3 x hidden wide); give 3 ids"
            )
        if recipe.training.gradient_checkpointing:
            problems.append(
                "training.gradient_checkpointing: a P-EAGLE draft runs every depth in one pass of one layer and "
                "does not checkpoint it; set false (or lower training.batch_size to save memory)"
            )
        if recipe.eval.engine == "llama.cpp":
            problems.append("eval.engine 'llama.cpp': llama.cpp has no P-EAGLE runtime; verify with 'native'")
        return problems
