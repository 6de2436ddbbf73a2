"""User-facing errors: the CLI prints these as one precise message, never as a traceback."""

from __future__ import annotations

import errno
import sys
from collections.abc import Callable
from typing import NoReturn


class UserError(Exception):
    """Bad input from the user (recipe, data, checkpoint, output directory): message says what and where."""


# What a failed system call means for the user, by errno, where the system's own words do not say it.
OS_HINTS = {
    errno.ENOSPC: "the disk is full: free space and rerun the same command to resume",
    errno.EDQUOT: "the disk quota is used up: free space and rerun the same command to resume",
    errno.ENOTDIR: "a file stands where a directory is needed",
    errno.EEXIST: "a file stands where a directory is needed",
    errno.EACCES: "no permission",
    errno.EROFS: "the filesystem is read-only",
}


def os_error(exc: OSError) -> str:
    """One line for a failed system call: the path, what the system said, and what it means."""
    names = " -> ".join(str(n) for n in (exc.filename, exc.filename2) if n is not None)
    said = exc.strerror or str(exc) or type(exc).__name__
    hint = OS_HINTS.get(exc.errno)
    return f"{names + ': ' if names else ''}{said}{f' ({hint})' if hint else ''}"


def run_script(main: Callable[[], int | None]) -> NoReturn:
    """Entry point of the scripts under eval/: a UserError (a recipe typo, a bad --set) prints as one line and
    exits 2, as in the CLI."""
    try:
        code = main()
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = 2
    except OSError as exc:
        print(f"error: {os_error(exc)}", file=sys.stderr)
        code = 2
    sys.exit(code)
