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


class Settings(FamilySettings):
    # One layer of the target's class over its whole vocabulary: a small fit is a few of EAGLE-3's steps.
    small: ClassVar[SmallDraft] = SmallDraft({"num_steps": 3}, steps=60)
    family: Literal["mtp"] = "mtp"
    num_steps: int = Field(3, gt=0, le=MAX_STEPS, description="Steps trained recursively (FastMTP: 3).")
    step_beta: float = Field(0.6, gt=0, le=1, description="Step k's loss weight is beta**k, normalised (FastMTP).")
    loss: Divergence = Field("ce", description="The divergence to the target's distribution per step.")
    style: Style = Field(
        "deepseek",
        description="How the engine runs the head: 'deepseek' for export.format mtp "
        "(vLLM's DeepSeek-V3 and GLM-4.5 MTP), 'qwen3_next' for export.format speculators (speculators' MTPDraftModel)",
    )

    formats: ClassVar[dict[str, str]] = {
        "mtp": "formats:MTPFormat",
        "speculators": "speculators_format:MTPSpeculatorsFormat",
    }
    vllm_format: ClassVar[str | None] = "mtp"
    # vLLM's MTP classes of DeepSeek-V3's layout (`formats.py`); Qwen3-Next's and Qwen3.5's read `mtp.*`.
    vllm_mtp_classes: ClassVar[tuple[str, ...]] = ("DeepSeekMTPModel", "Glm4MoeMTPModel")
    target_states: ClassVar[TargetStates] = "final"  # the last state, through the target's norm

    def target_problems(self, target_config: Any) -> list[str]:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        text = target_config.get_text_config()
        if text.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            return [
                f"draft.family 'mtp': the target's text decoder ({type(text).__name__}) has no causal-LM class in "
                "transformers, so its decoder layer cannot be built as the MTP head"
            ]
        return []

    def recipe_problems(self, recipe: Any) -> list[str]:
        problems = []
        if recipe.eval.mode == "tree":
            problems.append("eval.mode 'tree': an MTP head drafts chains here")
        wanted = {"mtp": "deepseek", "speculators": "qwen3_next"}.get(recipe.export.format)
        if wanted and self.style != wanted:
            problems.append(
                f"draft.style {self.style!r}: export.format {recipe.export.format!r} runs the head as {wanted!r}"
            )
        return problems
