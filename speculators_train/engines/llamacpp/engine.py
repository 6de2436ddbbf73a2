"""llama.cpp as the stages ask for it: llama-server serves a draft GGUF beside the target's own GGUF file."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from speculators_train.engines.base import Engine
from speculators_train.engines.llamacpp.serving import gguf_architecture, llamacpp_serving
from speculators_train.engines.serving import Serving


class LlamaCppEngine(Engine):
    name = "llama.cpp"
    command_prefix = "llama-server "
    export_formats: ClassVar[tuple[str, ...]] = ("gguf",)
    baselines: ClassVar[tuple[str, ...]] = ("ngram-simple", "ngram-cache", "ngram-mod")  # its n-gram spec types
    verify_runner = "verify:run_llamacpp"
    doctor_check = "doctor:check"

    def serving(
        self, target: Any, target_config: Any, settings: Any, nextn_classes: tuple[str, ...] | None = None
    ) -> Serving:
        reads = settings.target_states == "aux+final"
        return llamacpp_serving(target_config, gguf_architecture(target), reads)

    def decides_k(self, export_format: Any, out: Path, k: int) -> bool:
        """A format whose draft file llama-server loads beside the target's GGUF."""
        return bool(export_format.draft_file)


ENGINE = LlamaCppEngine()
