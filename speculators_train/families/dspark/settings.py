"""The recipe's `draft:` section for DSpark: DFlash's, plus its two heads."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from speculators_train.families.base import SmallDraft
from speculators_train.families.block.settings import Settings as DFlashSettings

MAX_MARKOV_RANK = 4096


class Settings(DFlashSettings):
    small: ClassVar[SmallDraft] = SmallDraft(
        {"block_size": 4, "num_layers": 1, "mask_token_id": 16, "draft_vocab_size": 512, "markov_rank": 32},
        learning_rate=3e-4,
    )
    family: Literal["dspark"] = "dspark"  # type: ignore[assignment]
    markov_rank: int = Field(
        256,
        ge=0,
        le=MAX_MARKOV_RANK,
        description="Rank of the Markov head's bias w2(w1[previous token]) on each slot's logits; 0: no Markov head.",
    )
    markov_head_type: Literal["vanilla", "gated", "rnn"] = Field(
        "vanilla",
        description="vanilla: the bias reads the previous token only (vLLM and llama.cpp serve it); gated: gated "
        "by the slot's output; rnn: a recurrent state over the block (speculators' variants).",
    )
    confidence_head: bool = Field(True, description="A head predicting each slot's acceptance (1 - TV).")
    confidence_head_with_markov: bool = Field(
        True, description="The confidence head also reads the Markov head's embedding of the previous token."
    )
    confidence_weight: float = Field(
        1.0, ge=0, description="Weight of the confidence head's BCE in the loss (speculators' confidence_head_alpha)."
    )

    formats: ClassVar[dict[str, str]] = {"speculators": "formats:DSparkFormat", "gguf": "gguf:GGUFFormat"}
    predicts_acceptance: ClassVar[bool] = True
    vllm_needs_gpu: ClassVar[bool] = True  # vLLM's V1 runner refuses `method: dspark` (tests/e2e/test_vllm.py)

    @property
    def auxiliary(self) -> tuple[float, float]:
        return (self.confidence_weight, 0.0)

    def recipe_problems(self, recipe: Any) -> list[str]:
        problems = super().recipe_problems(recipe)
        if self.confidence_head and self.confidence_head_with_markov and not self.markov_rank:
            problems.append("draft.confidence_head_with_markov needs a Markov head: set draft.markov_rank > 0")
        if recipe.eval.draft_p_min > 0 and not self.confidence_head:
            problems.append("eval.draft_p_min stops a DSpark chain by its confidence head: set draft.confidence_head")
        if recipe.eval.mode == "tree":
            problems.append("eval.mode 'tree': a DSpark slot reads the token drafted before it; verify chains")
        gguf = recipe.export.format == "gguf" or recipe.eval.engine == "llama.cpp"
        if gguf and self.markov_rank and self.markov_head_type != "vanilla":
            problems.append(
                f"draft.markov_head_type {self.markov_head_type!r}: llama.cpp runs the vanilla Markov head only"
            )
        return problems
