"""Child processes that never outlive the toolkit: each runs in its own process group, and when this process
unwinds (an error, Ctrl-C, SIGTERM) the whole group is ended, so a build's compilers, a converter or a server
are not left running under PID 1."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from typing import Any


def end_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM to the child's process group, SIGKILL after `grace` seconds; returns once the child is reaped."""
    if proc.poll() is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the leader is gone; its group may not be
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def group(cmd: list[str], reap: bool = False, **popen: Any) -> Iterator[subprocess.Popen]:
    """`subprocess.Popen(cmd, **popen)` in a new process group, ended with its group when the block exits; with
    `reap`, ended too if this process is killed outright (`reaped`: a watcher process, for a child that writes what
    a rerun would find half-done)."""
    proc = subprocess.Popen(cmd, start_new_session=True, **popen)
    try:
        if reap:
            import psutil

            with reaped([psutil.Process(proc.pid)]):
                yield proc
        else:
            yield proc
    finally:
        end_group(proc)


def run(cmd: list[str], reap: bool = False, **popen: Any) -> subprocess.CompletedProcess:
    """`subprocess.run` (text output captured with `capture_output=True`), the child's group ended if this
    process is interrupted while it runs (or, with `reap`, killed)."""
    capture = popen.pop("capture_output", False)
    if capture:
        popen.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with group(cmd, reap, **popen) as proc:
        out, err = proc.communicate()
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def end_processes(processes: list, grace: float = 5.0) -> None:
    """SIGTERM to `processes` (psutil.Process objects a library started), SIGKILL to those still running after
    `grace` seconds; returns once they are gone."""
    import psutil

    for proc in processes:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, running = psutil.wait_procs(processes, timeout=grace)
    for proc in running:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(running, timeout=grace)


# Reads its standard input until this process dies (the pipe's only writer), then SIGKILLs the processes it was
# given (pid and start time, so a reused pid is spared). argv: "pid:create_time" ...
_REAPER = r"""
import sys

import psutil

sys.stdin.buffer.read()
for entry in sys.argv[1:]:
    pid, created = entry.split(":")
    try:
        proc = psutil.Process(int(pid))
        if repr(proc.create_time()) == created:
            proc.kill()
    except psutil.Error:
        pass
"""


@contextlib.contextmanager
def reaped(processes: list) -> Iterator[None]:
    """Ends `processes` (psutil.Process objects that a library started, such as vLLM's engine) if this process is
    killed outright inside the block: a kill -9 runs no cleanup here, so a watcher process does it. On a normal
    exit the library ends them itself and the watcher is stopped."""
    import sys

    args = [f"{p.pid}:{p.create_time()!r}" for p in processes]
    watcher = subprocess.Popen([sys.executable, "-c", _REAPER, *args], stdin=subprocess.PIPE, start_new_session=True)
    try:
        yield
    finally:
        watcher.kill()
        watcher.wait()
        watcher.stdin.close()
