"""The recipe's `draft:` section for an MLP speculator."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from speculators_train.families.base import Divergence, FamilySettings, SmallDraft, TargetStates

MAX_STAGES = 16  # the published speculators have 3 to 5 stages; each holds a vocabulary-sized head


class Settings(FamilySettings):
    # Whole-vocabulary heads: a step of the small fit is 3-4x EAGLE-3's.
    small: ClassVar[SmallDraft] = SmallDraft({"n_predict": 3, "inner_dim": 128}, steps=60)
    family: Literal["mlp"] = "mlp"
    n_predict: int = Field(3, gt=0, le=MAX_STAGES, description="Stages: stage i proposes token t+2+i.")
    inner_dim: int = Field(0, ge=0, le=65_536, description="Width of each stage's state; 0: the target's width.")
    tie_weights: bool = Field(
        True, description="One embedding, norm and inner projection shared by every stage (heads stay apart)."
    )
    scale_input: bool = Field(True, description="Normalise the target's state (and divide by sqrt 2) first.")
    loss: Divergence = Field("forward_kl", description="The divergence to the target's distribution per stage.")
    stage_decay: float = Field(0.8, gt=0, le=1, description="Loss weight of stage i is stage_decay**i.")

    formats: ClassVar[dict[str, str]] = {"vllm": "formats:MLPSpeculatorFormat"}
    vllm_format: ClassVar[str | None] = None  # vLLM 0.32's V1 engine has no MLP speculator runtime
    target_states: ClassVar[TargetStates] = "final"  # the last state, through the target's norm

    def recipe_problems(self, recipe: Any) -> list[str]:
        problems = []
        if self.tie_weights and self.n_predict < 2:
            problems.append("draft.tie_weights needs n_predict >= 2 (vLLM's MLPSpeculator refuses one tied stage)")
        if recipe.eval.mode == "tree":
            problems.append("eval.mode 'tree': an MLP speculator drafts chains here")
        return problems
