"""The recipe's `draft:` section for EAGLE-3."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from speculators_train.families.base import Divergence, FamilySettings, SmallDraft


class Settings(FamilySettings):
    small: ClassVar[SmallDraft] = SmallDraft({"ttt_steps": 3, "draft_vocab_size": 512})
    family: Literal["eagle3"] = "eagle3"
    draft_vocab_size: int = Field(8192, gt=0, description="Reduced vocab from the generator's token counts.")
    ttt_steps: int = Field(7, gt=0, description="Training-time test unroll depth.")
    step_decay: float = Field(0.8, gt=0, le=1, description="Loss weight of step i is step_decay**i.")
    norm_before_residual: bool = Field(False, description="SGLang only runs false.")
    norm_before_fc: bool = Field(
        False, description="EAGLE-3.1: RMSNorm over the concatenated target states before fc (vLLM, llama.cpp)."
    )
    norm_output: bool = Field(
        False, description="EAGLE-3.1: feed the post-norm output back between steps (vLLM; llama.cpp ignores it)."
    )
    loss: Divergence = Field("ce", description="ce (soft cross-entropy) or another divergence; see docs/families.md.")

    formats: ClassVar[dict[str, str]] = {
        "speculators": "formats:SpeculatorsFormat",
        "sglang": "formats:SGLangFormat",
        "gguf": "gguf:GGUFFormat",
    }
    own_attention: ClassVar[bool] = True  # Llama/Qwen3 decoder layers of its own

    def recipe_problems(self, recipe: Any) -> list[str]:
        problems = []
        if recipe.data.max_length <= self.ttt_steps + 1:
            problems.append(
                f"data.max_length ({recipe.data.max_length}) must exceed draft.ttt_steps + 1 ({self.ttt_steps + 1})"
            )
        ids = recipe.target.aux_layer_ids
        if ids is not None and len(ids) != 3:
            problems.append(
                f"target.aux_layer_ids {ids}: an EAGLE-3 draft reads exactly 3 target states (vLLM, SGLang and "
                "llama.cpp build its fc 3 x hidden wide); give 3 ids"
            )
        if recipe.export.format == "sglang":
            problems += [
                f"export.format 'sglang' with draft.{flag} true: SGLang's LlamaForCausalLMEagle3 {what} and would "
                f"draft wrong tokens; export for vLLM (speculators) or train with false"
                for flag, what in SGLANG_LACKS.items()
                if getattr(self, flag)
            ]
        if recipe.export.format == "gguf" and self.norm_output:
            problems.append(
                "export.format 'gguf' with draft.norm_output true: llama.cpp feeds the pre-norm output back and "
                "ignores norm_output, so it would draft wrong tokens; export for vLLM (speculators) or train with false"
            )
        return problems


# What SGLang's EAGLE-3 layer cannot run as trained, by the setting that asks for it.
SGLANG_LACKS = {
    "norm_before_residual": "only implements false",
    "norm_before_fc": "has no norm before fc (it skips the input_norm weight unread)",
    "norm_output": "feeds the pre-norm output back",
}
