"""The recipe's `eval:` section (suites, chain or tree, engines and their settings): what `verify` runs, and
what a family's format and tree read. Kept apart from `recipe.py` so the families can name it without importing
the recipe, which imports them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from speculators_train import engines
from speculators_train.engines.base import MAX_DRAFT_TOKENS
from speculators_train.engines.llamacpp.settings import LlamaCppConfig
from speculators_train.engines.vllm.settings import VllmConfig
from speculators_train.schema import Section

# The most nodes a tree may verify (EAGLE's trees are 60-ish nodes), beside the most draft tokens of one step
# (`MAX_DRAFT_TOKENS`): low enough that a typo cannot make every step a forward of thousands of positions.
MAX_TREE_BUDGET = 1024

# `native` is this toolkit's own loop; every other value is a registered engine that `verify` runs (sorted, so the
# choices read as they always have whatever the registry's order).
ENGINE_CHOICES = ("native", *sorted(engines.verifying()))
EngineName = Literal[ENGINE_CHOICES]


class TreeConfig(Section):
    top_k: int = Field(4, gt=0, description="Children per expanded node, and nodes expanded per depth.")
    depth: int = Field(5, gt=0, le=MAX_DRAFT_TOKENS, description="Draft steps per verify step.")
    budget: int = Field(24, gt=0, le=MAX_TREE_BUDGET, description="Draft nodes verified per step (the most probable).")
    shape: Literal["dynamic", "measured"] = Field(
        "dynamic",
        description="dynamic: each step keeps the `budget` most probable paths (any draft); other shapes belong to "
        "a family (its settings' tree_shapes), e.g. one fixed tree built from held-out per-head rank accuracies.",
    )


class EvalConfig(Section):
    suites: list[str] = Field(
        default_factory=lambda: ["eval/suites/sharegpt-held-out.yaml"],
        min_length=1,  # a verify run with no suite would measure nothing and exit 0
        description="Suite YAML files.",
    )
    mode: Literal["chain", "tree"] = "chain"
    num_speculative_tokens: int = Field(
        5, gt=0, le=MAX_DRAFT_TOKENS, description="K, draft tokens per verify step (chain mode)."
    )
    tree: TreeConfig = Field(default_factory=TreeConfig)
    temperatures: list[float] = Field(default_factory=lambda: [0.0], description="0 = greedy; one run each.")
    top_p: float = Field(1.0, gt=0, le=1)
    draft_sampling: Literal["argmax", "sample"] = Field(
        "argmax",
        description="How a chain drafts at temperature > 0: argmax, as vLLM and SGLang do (so AL at T > 0 here "
        "predicts theirs), or sample from the draft's softmax(logits / T); the output is the target's either way.",
    )
    draft_p_min: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Stop a chain at the first draft token predicted below this (0: never): llama.cpp's "
        "--spec-draft-p-min (the draft's own probability, or its confidence head where it has one); this loop: "
        "drafts with a confidence head.",
    )
    baselines: list[Literal["ngram"]] = Field(
        default_factory=lambda: ["ngram"],
        description="native: draftless methods decoded beside the draft on the same prompts at T = 0 (ngram: "
        "prompt lookup, as vLLM's `ngram`), each its own record: whether training paid for these prompts.",
    )
    num_prompts: int | None = Field(None, gt=0, description="Override every suite's prompt count.")
    max_new_tokens: int | None = Field(None, gt=0, description="Override every suite's generation length.")
    engine: EngineName = Field(
        "native",
        description="native: this toolkit's loop on the target in transformers; llama.cpp: llama-server on the "
        "target's GGUF with the draft exported to GGUF (EAGLE-3), greedy; vllm: vLLM on the target's HF folder "
        "with the draft's vLLM export, chains, at every temperature (verify --engine overrides it).",
    )
    llama_cpp: LlamaCppConfig = Field(default_factory=LlamaCppConfig)
    vllm: VllmConfig = Field(default_factory=VllmConfig)

    @field_validator("temperatures")
    @classmethod
    def _temperatures(cls, value: list[float]) -> list[float]:
        if not value or any(t < 0 for t in value):
            raise ValueError("must be a non-empty list of temperatures >= 0")
        return value

    def engine_problems(self, recipe: Any) -> list[str]:
        """The rules `engine` holds `recipe` to (its `Engine.recipe_problems`; the loop's are the recipe's own)."""
        return [] if self.engine == "native" else engines.get(self.engine).recipe_problems(recipe)
