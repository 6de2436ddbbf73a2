"""User-facing errors: the CLI prints these as one precise message, never as a traceback."""

from __future__ import annotations

import errno
import signal
import sys
import threading
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


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler, `timeout`, `docker stop`), raised where the process stands so it unwinds as Ctrl-C
    does: context managers end the engine processes they started, temporary files are removed, and the state on
    disk is the one the last commit left."""


def _terminated(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not interrupt the cleanup
    raise Terminated()


def terminate_like_interrupt() -> None:
    """Treat SIGTERM as Ctrl-C in this process (a handler can only be set from the main thread)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminated)


def interrupted(exc: KeyboardInterrupt) -> tuple[str, int]:
    """The line and exit code for Ctrl-C or SIGTERM: 130 and 143, as a shell reports a process those signals end."""
    if isinstance(exc, Terminated):
        return "terminated (SIGTERM): rerun the same command to resume", 128 + signal.SIGTERM
    return "interrupted: rerun the same command to resume", 128 + signal.SIGINT


def run_script(main: Callable[[], int | None]) -> NoReturn:
    """Entry point of the scripts under eval/: a UserError (a recipe typo, a bad --set) prints as one line and
    exits 2, as in the CLI; SIGTERM unwinds as Ctrl-C does."""
    terminate_like_interrupt()
    try:
        code = main()
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = 2
    except OSError as exc:
        print(f"error: {os_error(exc)}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt as exc:
        message, code = interrupted(exc)
        print(message, file=sys.stderr)
    sys.exit(code)
