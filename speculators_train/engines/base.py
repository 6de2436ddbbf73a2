"""What a serving engine is: one object, `ENGINE` in `engines/<folder>/engine.py`, that every stage asks for
engine-specific work instead of testing the engine's name.

    engine.py     ENGINE: its name as users write it, how its serve lines begin, the export formats it is the
                  engine for, whether its verify records decide an export's K, its draftless baselines, the rules a
                  recipe verifying in it is held to, and where its serving check, verify runner and doctor check are
    serving.py    whether it serves a family's draft on a target, asked of the engine's own code
    settings.py   its recipe section, `eval.<section>` (an engine `verify` runs)
    verify.py     `verify --engine <name>`: the recipe's suites decoded by the engine itself
    doctor.py     `doctor --engine <name>`: the export as the engine reads it

A verify runner and a doctor check use the stages above this layer (export, verify, doctor), so they are layers
of their own (`engines.verify`, `engines.doctor` in docs/architecture.md) and an engine names them as
"module:attr" in its folder, imported when a stage asks (as a family names its export formats). This module
imports no torch: the recipe's `eval.engine` reads the registry when a recipe loads.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from speculators_train.engines.serving import Serving

# The most draft tokens one verify step may carry (chain K, tree depth) in the loop or any engine: far above what
# pays on any of them (vLLM and SGLang recipes use K <= 8), low enough that a typo cannot make every step a forward
# of thousands of positions.
MAX_DRAFT_TOKENS = 64


class Engine:
    """A serving engine; the defaults are an engine this toolkit prints serve lines for and checks nothing of."""

    name: ClassVar[str]  # as users write it: eval.engine, --engine, the `engine` of its verify records
    command_prefix: ClassVar[str]  # how the serve lines an export prints for it begin
    export_formats: ClassVar[tuple[str, ...]] = ()  # the export.format values it is the engine for
    baselines: ClassVar[tuple[str, ...]] = ()  # its draftless methods, run beside the draft in its verify runs
    # "module:attr" in its folder of `run(recipe, suites, loaded, out_dir) -> records`; None: `verify` cannot run it
    verify_runner: ClassVar[str | None] = None
    # "module:attr" in its folder of `check(doctor.serve.ServedExport) -> Check`: the export as it reads it
    doctor_check: ClassVar[str | None] = None

    @property
    def verifies(self) -> bool:
        """Whether `verify` runs it here (an `eval.engine` value), with records of its own that doctor reads."""
        return self.verify_runner is not None

    def serving(
        self, target: Any, target_config: Any, settings: Any, nextn_classes: tuple[str, ...] | None = None
    ) -> Serving | None:
        """Whether it serves a draft of the family whose recipe section is `settings` on the recipe's `target`
        (`target_config`: its transformers config; `nextn_classes`: the vLLM MTP classes that read this draft's
        export, where narrower than the family's). None: it has no check here, and its lines print as written."""
        return None

    def decides_k(self, export_format: Any, out: Path, k: int) -> bool:
        """Whether its verify records decide the K an export in `export_format` at `out` serves."""
        return False

    def recipe_problems(self, recipe: Any) -> list[str]:
        """The rules a recipe whose `eval.engine` names it is held to, checked when the recipe loads."""
        return []

    def runner(self) -> Callable[..., list[dict[str, Any]]]:
        """Its verify runner (`verify_runner`), imported now."""
        assert self.verify_runner is not None, f"{self.name}: verify does not run it"
        return self._load(self.verify_runner)

    def doctor(self) -> Callable[..., Any] | None:
        """Doctor's check of an export as it reads it (`doctor_check`), imported now; None where it has none."""
        return None if self.doctor_check is None else self._load(self.doctor_check)

    def _load(self, where: str) -> Any:
        package = type(self).__module__.rsplit(".", 1)[0]
        module, attr = where.split(":")
        return getattr(import_module(f"{package}.{module}"), attr)
