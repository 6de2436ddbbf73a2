"""The recipe's `draft:` section for a standalone draft model: a small causal LM sharing the target's tokenizer,
distilled from the target's distribution (DistillSpec, arXiv 2310.08461; OSD, arXiv 2310.07177)."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from speculators_train.families.base import Divergence, FamilySettings, SmallDraft, TargetStates


class Settings(FamilySettings):
    # Whole-vocabulary embeddings: a step of the small fit is 3-4x EAGLE-3's.
    small: ClassVar[SmallDraft] = SmallDraft({"layers": [0, 1]}, steps=30)
    family: Literal["draft_model"] = "draft_model"
    start: str = Field(
        "target_layers",
        description="target_layers: a copy of the target keeping `layers`; fresh: a randomly initialised model of "
        "the target's architecture with `fresh_config` applied; else a hub id or folder of a smaller model with the "
        "target's tokenizer.",
    )
    layers: list[int] = Field([0, 1], min_length=1, description="The target's layers a target_layers draft keeps.")
    fresh_config: dict[str, int | float] = Field(
        {"num_hidden_layers": 2},
        description="start: fresh: keys of the target's config to change (num_hidden_layers, hidden_size, "
        "intermediate_size, num_attention_heads, ...); the vocabulary stays the target's.",
    )
    loss: Divergence = Field("forward_kl", description="The divergence to the target's distribution (DistillSpec).")

    formats: ClassVar[dict[str, str]] = {"hf": "formats:ModelFolderFormat", "gguf": "formats:GGUFFormat"}
    vllm_format: ClassVar[str | None] = "hf"  # method: draft_model
    target_states: ClassVar[TargetStates] = "final"  # the target's distribution, through its norm and head

    def target_problems(self, target_config: Any) -> list[str]:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        text = target_config.get_text_config()
        if self.start in ("target_layers", "fresh") and text.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            return [
                f"draft.start {self.start!r}: the target's text decoder ({type(text).__name__}) has no causal-LM class "
                "in transformers, so a draft of its own architecture cannot be built (nor served by an engine as a "
                "draft model); set draft.start to a small causal LM with the target's tokenizer (e.g. "
                "Qwen2.5-0.5B-Instruct for Qwen2.5-VL)"
            ]
        if self.start == "target_layers" and max(self.layers) >= text.num_hidden_layers:
            return [f"draft.layers {self.layers}: the target has {text.num_hidden_layers} layers"]
        return self._recurrent_problems(target_config)

    def _recurrent_problems(self, target_config: Any) -> list[str]:
        """A draft LM proposes a token at a time and drops its rejected ones from its cache; a recurrent layer's state
        cannot be cut back that way, so the draft takes the target's other layers only."""
        from speculators_train.architectures import RECURRENT_LAYERS, layer_types

        kinds = layer_types(target_config)
        others = [i for i, kind in enumerate(kinds) if kind not in RECURRENT_LAYERS]
        chosen = self.layers if self.start == "target_layers" else []
        if self.start == "fresh":  # the target's pattern of kinds cycled over the draft's depth: its first layers
            chosen = range(min(int(self.fresh_config.get("num_hidden_layers", len(kinds))), len(kinds)))
        recurrent = [i for i in chosen if kinds[i] in RECURRENT_LAYERS]
        if not recurrent:
            return []
        where = f"draft.layers {self.layers}" if self.start == "target_layers" else "draft.start 'fresh'"
        fix = (
            f"take draft.start 'target_layers' with draft.layers among {others}"
            if others
            else "set draft.start to a small causal LM with the target's tokenizer"
        )
        return [
            f"{where}: target layer {recurrent[0]} is {kinds[recurrent[0]]}, whose recurrent state a draft cannot cut "
            f"back to its accepted tokens; {fix}"
        ]

    def recipe_problems(self, recipe: Any) -> list[str]:
        problems = []
        if self.start == "target_layers" and (min(self.layers) < 0 or self.layers != sorted(set(self.layers))):
            problems.append(f"draft.layers {self.layers}: ascending, distinct target layer ids >= 0")
        if self.start not in ("target_layers", "fresh"):
            from speculators_train.errors import UserError
            from speculators_train.folders import check_model_folder

            try:  # a folder from elsewhere: no custom code, safetensors only, a config a model runs with
                check_model_folder(self.start, "draft.start")
            except UserError as exc:
                problems.append(str(exc))
        return problems
