"""The hostile-input and fault-injection suite: every bad input ends in one clean line or a counted skip, and a
kill -9 at any crash window loses and repeats nothing.

`clean_error` is the one assertion a bad input must pass: the CLI exits 2 and prints a single `error:` line that
names the file (or key) at fault, never a traceback.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from speculators_train.cli import main
from tests.children import run_python
from tests.conftest import FULL, REPO


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """Run the CLI in this process; returns (exit code, stderr with rich's wrapping undone)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in argv])
    err = capsys.readouterr().err
    return int(exit_info.value.code or 0), err


def clean_error(argv: list[str], capsys, *needles: str) -> str:
    """The CLI refuses `argv` with exit 2 and one `error:` message holding every needle (no traceback)."""
    code, err = run_cli(argv, capsys)
    text = " ".join(err.split())
    assert code == 2, f"exit {code}, expected 2:\n{err}"
    assert "Traceback" not in err, err
    assert "error: " in text, err  # after any progress bar the command drew before it stopped
    for needle in needles:
        assert needle in text, f"{needle!r} not in: {text}"
    return text


def mount_tmpfs(path: Path, size: int) -> bool:
    """A real filesystem of `size` bytes at `path` (root only): a write past it fails on ENOSPC."""
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]).returncode == 0


# A child process that runs the CLI and SIGKILLs itself at the Nth call of chosen functions ("events"), so a
# test hits a crash window by its event number, independent of machine speed. argv: die_at (N, or N@NAME: the Nth
# call of the event NAME alone), then CLI args.
# Events: every os.replace (the commit point of every atomic write) and os.fsync, plus any extra
# "module:attribute" names in SPECULATORS_TRAIN_FAULT_EVENTS (comma separated). die_at 0 runs to the end and
# prints one label per event to stderr ("event: LABEL"): the function and the file it commits (digits as N) or
# its caller, so a test can pick one event of each kind.
KILLER = r"""
import importlib, os, re, signal, sys

count, _, only = sys.argv[1].partition("@")
die_at, seen = int(count), 0


def dying(fn, name):
    def wrapped(*args, **kwargs):
        global seen
        seen += not only or name == only
        if seen == die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if die_at == 0:
            caller = sys._getframe(1).f_code.co_name
            detail = os.path.basename(str(args[1])) if name == "os.replace" else caller
            print("event:", name, re.sub(r"[0-9]+", "N", detail), file=sys.stderr)
        return fn(*args, **kwargs)
    return wrapped


os.replace, os.fsync = dying(os.replace, "os.replace"), dying(os.fsync, "os.fsync")
for name in filter(None, os.environ.get("SPECULATORS_TRAIN_FAULT_EVENTS", "").split(",")):
    module, _, attr = name.partition(":")
    owner_name, _, leaf = attr.rpartition(".")
    owner = importlib.import_module(module)
    for part in filter(None, owner_name.split(".")):
        owner = getattr(owner, part)
    setattr(owner, leaf, dying(getattr(owner, leaf), attr))
from speculators_train.cli import main
main(sys.argv[2:])
"""


def run_killed(die_at: int | str, argv: list[str], events: list[str] = (), timeout: int = 600) -> tuple[int, str]:
    """Run the CLI in a child that SIGKILLs itself at event `die_at` (0: never; "N@name": the Nth call of the event
    `name`, such as "2@process_chunk"). Returns (returncode, stderr); returncode is -SIGKILL when the kill
    happened."""
    env = {**os.environ, "SPECULATORS_TRAIN_FAULT_EVENTS": ",".join(events)}
    proc = run_python(KILLER, [die_at, *argv], env=env, cwd=REPO, timeout=timeout)
    assert proc.returncode in (0, -signal.SIGKILL), proc.stderr[-3000:]
    return proc.returncode, proc.stderr


def event_labels(argv: list[str], events: list[str] = ()) -> list[str]:
    """The events a clean run of `argv` passes through, in order (it runs to the end)."""
    code, err = run_killed(0, argv, events)
    assert code == 0, err
    # A progress bar may share the line (it redraws with \r, no newline): take what follows each marker.
    labels = re.findall(r"event: ([^\r\n]*)", err)
    assert labels, err
    return labels


def crash_windows(labels: list[str], tail: int) -> list[int]:
    """Events (1-based) to kill at: all of them when SPECULATORS_TRAIN_FULL=1, else the first of each
    kind (label) and the last `tail` (the run's final save and validation)."""
    if FULL:
        return list(range(1, len(labels) + 1))
    first = {label: n for n, label in reversed(list(enumerate(labels, 1)))}
    return sorted(set(first.values()) | set(range(max(1, len(labels) - tail + 1), len(labels) + 1)))
