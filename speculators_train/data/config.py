"""The recipe's `data:` section: the mix, the sample length, the held-out split, and regeneration of replies.

Kept next to the data code that reads it, and apart from it so that loading a recipe imports no torch: the recipe
(`recipe.py`) composes this section, and the data, generation and training stages read it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from speculators_train.schema import Section


class RegenerateConfig(Section):
    """Replace assistant turns with the target's own responses (drafts trained on them accept more)."""

    enabled: bool = False
    temperature: float = Field(0.0, ge=0.0, description="0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(512, gt=0)
    batch_size: int = Field(16, gt=0, description="Prompts decoded together (llama.cpp: the server's parallel slots).")
    engine: Literal["transformers", "llama.cpp", "vllm"] = Field(
        "transformers",
        description="llama.cpp: llama-server decodes the replies from the target's GGUF file, `batch_size` at once "
        "in parallel slots (the quantized file that is served, not a float copy); vllm: vLLM's offline batch "
        "generation on the target's HF folder, each turn's requests in one call; hidden states are still captured "
        "in transformers.",
    )
    max_turns: int | None = Field(None, gt=0, description="Keep only the first N exchanges of each conversation.")
    model: str | None = Field(
        None,
        description="Hub id or folder of the model that writes the replies in place of the target (transformers "
        "and vllm engines); its tokenizer must be the target's. A standalone draft here (an `hf` export, or the "
        "model `draft.start` names) gives on-policy data: the draft's own replies, scored by the target's states "
        "(DistillSpec). The states are always the target's.",
    )

    @classmethod
    def identity(cls, settings: dict[str, Any]) -> dict[str, Any]:
        """What decides the stored text: nothing but `enabled` when off, and a stored dict written before a
        setting existed reads as that setting's default, so adding an option never invalidates old outputs."""
        config = cls.model_validate(settings)
        return config.model_dump() if config.enabled else {"enabled": False}


class ImagesConfig(Section):
    fetch: bool = Field(
        False,
        description="Fetch records' http(s) image references over the network. Off: such a record is skipped and "
        "counted (files and data URLs are always read). Credentials in a URL are never sent.",
    )
    timeout_seconds: float = Field(30.0, gt=0, le=600, description="Total deadline to fetch one image.")
    max_bytes: int = Field(32 * 2**20, gt=0, le=2**30, description="The largest image file or download read.")


class DataConfig(Section):
    mix: str = Field(description="Path to a data mix YAML (see data/*.yaml).")
    max_length: int = Field(2048, gt=1, description="Tokens per sample after the chat template.")
    overlong: Literal["truncate", "drop"] = Field("truncate", description="What to do past max_length.")
    held_out_fraction: float = Field(
        0.02, ge=0.0, lt=1.0, description="Share of record ids held out (decided by id hash, never trained on)."
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Passed to the target's chat template wherever it renders (training data, regeneration prompts, "
        "verify prompts), as a server's `chat_template_kwargs`: e.g. {enable_thinking: false} for a Qwen3 target "
        "served without reasoning.",
    )
    regenerate: RegenerateConfig = Field(default_factory=RegenerateConfig)
    images: ImagesConfig = Field(default_factory=ImagesConfig)
