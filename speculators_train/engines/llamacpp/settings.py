"""`eval.llama_cpp`: what `verify --engine llama.cpp` runs (`verify.py`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from speculators_train.engines.base import MAX_DRAFT_TOKENS
from speculators_train.engines.llamacpp.engine import ENGINE
from speculators_train.schema import Section


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
    baselines: list[Literal[ENGINE.baselines]] = Field(
        default_factory=lambda: list(ENGINE.baselines),
        description="llama.cpp's draftless methods run on the same prompts, with their defaults.",
    )
    threads: int | None = Field(None, gt=0, description="llama.cpp threads; default: every core this process has.")

    @field_validator("speculative_tokens")
    @classmethod
    def _ks(cls, value: list[int]) -> list[int]:
        if any(k < 1 or k > MAX_DRAFT_TOKENS for k in value):
            raise ValueError(f"each K must be >= 1 and <= {MAX_DRAFT_TOKENS}")
        return value
