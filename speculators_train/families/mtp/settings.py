"""The recipe's `draft:` section for an MTP head."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from speculators_train.families.base import Divergence, FamilySettings, SmallDraft, TargetStates

MAX_STEPS = 16
# How an engine runs the head, each trained as served: "deepseek" zeroes the embedding at position 0 and feeds the
# block's pre-norm output back (vLLM's DeepSeek-V3 and GLM-4.5 MTP); "qwen3_next" feeds the normed output back and
# zeroes nothing (vLLM's Qwen3-Next and Qwen3.5 MTP, speculators' MTPDraftModel).
Style = Literal["deepseek", "qwen3_next"]
# vLLM's MTP classes that run each style, each reading that style's layout (`formats.py`)
STYLE_CLASSES: dict[str, tuple[str, ...]] = {
    "deepseek": ("DeepSeekMTPModel", "Glm4MoeMTPModel"),
    "qwen3_next": ("Qwen3NextMTP", "Qwen3_5MTP", "Qwen3_5MoeMTP"),
}


class Settings(FamilySettings):
    # One layer of the target's class over its whole vocabulary: a small fit is a few of EAGLE-3's steps.
    small: ClassVar[SmallDraft] = SmallDraft({"num_steps": 3}, steps=60)
    family: Literal["mtp"] = "mtp"
    num_steps: int = Field(3, gt=0, le=MAX_STEPS, description="Steps trained recursively (FastMTP: 3).")
    step_beta: float = Field(0.6, gt=0, le=1, description="Step k's loss weight is beta**k, normalised (FastMTP).")
    loss: Divergence = Field("ce", description="The divergence to the target's distribution per step.")
    style: Style = Field(
        "deepseek",
        description="How the engine runs the head: 'deepseek' for vLLM's DeepSeek-V3 and GLM-4.5 MTP, 'qwen3_next' "
        "for vLLM's Qwen3-Next and Qwen3.5 MTP and for export.format speculators (speculators' MTPDraftModel)",
    )

    formats: ClassVar[dict[str, str]] = {
        "mtp": "formats:MTPFormat",
        "speculators": "speculators_format:MTPSpeculatorsFormat",
    }
    vllm_format: ClassVar[str | None] = "mtp"
    vllm_mtp_classes: ClassVar[tuple[str, ...]] = (*STYLE_CLASSES["deepseek"], *STYLE_CLASSES["qwen3_next"])
    target_states: ClassVar[TargetStates] = "final"  # the last state, through the target's norm

    def target_problems(self, target_config: Any) -> list[str]:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        text = target_config.get_text_config()
        if text.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            return [
                f"draft.family 'mtp': the target's text decoder ({type(text).__name__}) has no causal-LM class in "
                "transformers, so its decoder layer cannot be built as the MTP head"
            ]
        from speculators_train.families.mtp.model import block_problem

        return [problem] if (problem := block_problem(text)) else []

    def recipe_problems(self, recipe: Any) -> list[str]:
        problems = []
        if recipe.eval.mode == "tree":
            problems.append("eval.mode 'tree': an MTP head drafts chains here")
        if recipe.export.format == "speculators" and self.style != "qwen3_next":
            problems.append(
                f"draft.style {self.style!r}: export.format 'speculators' (MTPDraftModel) runs the head as 'qwen3_next'"
            )
        return problems
