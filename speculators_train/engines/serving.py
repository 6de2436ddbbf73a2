"""Whether an engine serves a family's export on a target, asked of the engine's own code (each engine's
`serving.py`), and the serve lines an export prints, kept where their engine serves the draft. Nothing here names
a family: a family declares the states it reads and whether its draft has attention of its own.

Asking an engine is slow (importing vLLM takes 15-20 s, llama.cpp's converter runs as a child), so answers are
kept per engine version and architecture under the cache directory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from speculators_train import engines
from speculators_train.files import atomic_write_json
from speculators_train.loading import read_json
from speculators_train.origin import cache_root

FACTS_LAYOUT = 3  # the shape of a cached answer: a new shape is a new cache file


@dataclass
class Serving:
    """An engine's answer for one draft family on one target: `problems` rule it out anywhere; `here` rule it out on
    this machine only (a GPU build or a package this environment lacks would serve it)."""

    engine: str
    problems: list[str] = field(default_factory=list)
    here: list[str] = field(default_factory=list)

    @property
    def runs_here(self) -> bool:
        return not self.problems and not self.here


def cached(name: str, key: str, compute: Callable[[], Any]) -> Any:
    """`compute()` once per cache file `name` and `key`: engine facts change only with the engine's version."""
    path = cache_root() / "engines" / f"{name}.json"
    known = read_json(path, "engine facts") if path.is_file() else {}
    if key not in known:
        known = {**known, key: compute()}
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, known)
    return known[key]


def package_version(*packages: str) -> str | None:
    """`<package>-<version>` of the first of `packages` installed here, None when none is."""
    for package in packages:
        try:
            return f"{package}-{metadata.version(package)}"
        except metadata.PackageNotFoundError:
            continue
    return None


def serving(
    engine: str, target: Any, target_config: Any, settings: Any, nextn_classes: tuple[str, ...] | None = None
) -> Serving:
    """Whether `engine` serves a draft of the family whose recipe section is `settings` on the recipe's `target`
    (its `TargetConfig`; `target_config` is its transformers config); `nextn_classes`: the vLLM MTP classes that
    read this draft's export, where narrower than the family's. Only an engine with a check of its own is asked
    (every engine `verify` runs has one): another engine's answer is no answer for it."""
    answer = engines.get(engine).serving(target, target_config, settings, nextn_classes)
    if answer is None:
        raise ValueError(f"engine {engine!r} has no serving check")
    return answer


def served_commands(
    target: Any, target_config: Any, settings: Any, commands: list[str], nextn_classes: tuple[str, ...] | None = None
) -> tuple[list[str], list[str]]:
    """The serve lines that run, and a note for each one left out (its engine cannot serve this draft on this
    target) or that runs elsewhere only (on a GPU, with a package this machine lacks); `nextn_classes` as
    `serving` takes them. A line of no registered engine, or of one without a check here, is kept as written."""
    kept, notes = [], []
    known = engines.all_engines()
    for line in commands:
        engine = next((e for e in known if line.startswith(e.command_prefix)), None)
        answer = None if engine is None else engine.serving(target, target_config, settings, nextn_classes)
        if engine is None or answer is None:
            kept.append(line)
            continue
        if answer.problems:
            notes.append(f"no {engine.name} command: {'; '.join(answer.problems)}")
            continue
        kept.append(line)
        notes += [f"{engine.name}: {why}" for why in answer.here]
    return kept, notes
