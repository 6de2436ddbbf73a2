"""vLLM as the stages ask for it: the serve lines it owns, when its records decide K, and what a recipe verifying
in it must not ask for."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from speculators_train.engines.base import Engine
from speculators_train.engines.serving import Serving
from speculators_train.engines.vllm.serving import vllm_serving


class VllmEngine(Engine):
    name = "vllm"
    command_prefix = "vllm serve "
    # no export.format of its own: every format no other engine claims is its (the registry's first)
    baselines: ClassVar[tuple[str, ...]] = ("ngram", "suffix")  # its draftless speculative methods
    verify_runner = "verify:run_vllm"
    doctor_check = "doctor:check"

    def serving(
        self, target: Any, target_config: Any, settings: Any, nextn_classes: tuple[str, ...] | None = None
    ) -> Serving:
        nextn = settings.vllm_mtp_classes if nextn_classes is None else nextn_classes
        reads = settings.target_states == "aux+final"
        return vllm_serving(target_config, reads, settings.own_attention, settings.vllm_needs_gpu, nextn)

    def decides_k(self, export_format: Any, out: Path, k: int) -> bool:
        """A format vLLM serves as a speculative method (the family's `vllm_format`)."""
        return export_format.vllm_speculative_config(out, k) is not None

    def recipe_problems(self, recipe: Any) -> list[str]:
        draft, ev = recipe.draft, recipe.eval
        problems = []
        if ev.draft_p_min:
            problems.append("eval.draft_p_min: vLLM has no such stop; verify with 'llama.cpp' or 'native'")
        if draft.vllm_format is None:
            problems.append(
                f"eval.engine 'vllm': vLLM serves no {draft.family} draft (no format of this family is one its "
                f"engine runs as a speculative method); verify with 'native'"
            )
        if ev.mode == "tree":
            problems.append("eval.engine 'vllm': vLLM drafts chains here; set eval.mode: chain")
        return problems


ENGINE = VllmEngine()
