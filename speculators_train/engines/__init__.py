"""The registry of serving engines: one line each. An engine is the folder of that name here, holding `engine.py`
(`ENGINE`, an `engines.base.Engine`) and what it runs (see `base.py`). Stages never test an engine's name: they
ask `get(name)`, or the registry for every engine, and ask the object."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from speculators_train.errors import UserError

if TYPE_CHECKING:
    from speculators_train.engines.base import Engine

ENGINES = (
    "vllm",  # vLLM, offline here (CPU build or GPU); first: the engine of every export format no other one claims
    "llamacpp",  # llama.cpp (`llama.cpp`): llama-server built from source, a draft GGUF beside the target's GGUF
    "sglang",  # SGLang: does not run here; its serve lines print as written and doctor applies its loader's rules
)


def all_engines() -> list[Engine]:
    """Every engine's object, in registry order (cheap: no torch)."""
    return [import_module(f"{__name__}.{folder}.engine").ENGINE for folder in ENGINES]


def names() -> tuple[str, ...]:
    """Every engine's name as users write it (`--engine` of doctor)."""
    return tuple(engine.name for engine in all_engines())


def verifying() -> tuple[str, ...]:
    """The engines `verify` runs here (`eval.engine` besides the loop's own `native`)."""
    return tuple(engine.name for engine in all_engines() if engine.verifies)


def get(name: str) -> Engine:
    found = next((engine for engine in all_engines() if engine.name == name), None)
    if found is None:
        raise UserError(f"unknown engine {name!r} (registered: {', '.join(names())})")
    return found


def for_format(export_format: str) -> Engine:
    """The engine an export in `export_format` is for: the one that claims it, else the first registered."""
    engines = all_engines()
    return next((engine for engine in engines if export_format in engine.export_formats), engines[0])
