"""User-facing errors: the CLI prints these as one precise message, never as a traceback."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NoReturn


class UserError(Exception):
    """Bad input from the user (recipe, data, checkpoint, output directory): message says what and where."""


def run_script(main: Callable[[], int | None]) -> NoReturn:
    """Entry point of the scripts under eval/: a UserError (a recipe typo, a bad --set) prints as one line and
    exits 2, as in the CLI."""
    try:
        code = main()
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = 2
    sys.exit(code)
