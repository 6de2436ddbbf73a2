"""What produced a run: command line, git commit, package versions and the exact recipe, saved beside it."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path
from typing import Any

from speculators_train.files import atomic_write_json

PACKAGES = ("speculators_train", "torch", "transformers", "accelerate", "deepspeed", "safetensors", "datasets")


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, cwd=Path(__file__).resolve().parent
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def write_run_info(path: Path, recipe_dump: dict[str, Any]) -> None:
    """At `path` (`layout.RUN_INFO` in the stage's directory)."""
    atomic_write_json(
        path,
        {
            "argv": sys.argv,
            "git_commit": _git_commit(),
            "versions": {name: _version(name) for name in PACKAGES},
            "recipe": recipe_dump,
        },
    )
