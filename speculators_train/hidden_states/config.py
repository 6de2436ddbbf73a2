"""The recipe's `generation:` section: how hidden states are made (stored shards or captured in the loop).

Kept next to the generator that reads it, and apart from it so that loading a recipe imports no torch: the recipe
(`recipe.py`) composes this section.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from speculators_train.schema import DTypeName, Section


class GenerationConfig(Section):
    hidden_states: Literal["offline", "online"] = Field(
        "offline", description="offline: write shards to disk; online: capture in memory while training."
    )
    storage_dtype: DTypeName = Field("bfloat16", description="dtype of stored hidden states.")
    samples_per_shard: int = Field(256, gt=0, description="Also the unit of resume after a crash.")
    max_tokens_per_batch: int = Field(8192, gt=0, description="Padded tokens per target forward (transformers).")
    engine: Literal["transformers", "vllm"] = Field(
        "transformers",
        description="Which runs the target for `generate`: transformers (this process holds the model), or vLLM's "
        "extract_hidden_states method (vLLM holds it, sharded over tensor_parallel_size GPUs; the transformers "
        "weights are never loaded). Online states and online distillation always capture in transformers.",
    )
    tensor_parallel_size: int = Field(
        1, gt=0, description="GPUs each rank's vLLM engine splits the target over (engine: vllm)."
    )
