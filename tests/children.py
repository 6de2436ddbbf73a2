"""Python child processes for tests that kill or isolate a run, started without a fresh interpreter's imports.

Crash and fault tests run the CLI (or a small script) in a child they can SIGKILL. A fresh `python -c` pays the
torch and transformers imports each time, seconds per child on a small CPU. Here each child is forked from one
multiprocessing fork server per test session that has already imported them (and nothing else has run in it: no
threads, no model), so a child starts in milliseconds and still behaves like `python -c CODE ARGS...`: its own
process, pid, environment, working directory, stdout and stderr, and a return code that is minus the signal when a
signal ended it. The server imports `tests.preload` with the environment of the session's first child; children get
the caller's environment at call time.
"""

from __future__ import annotations

import builtins
import multiprocessing
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

_context: multiprocessing.context.ForkServerContext | None = None


def _server() -> multiprocessing.context.ForkServerContext:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload([__name__, "tests.preload"])
    return _context


def _child(code: str, argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = ["-c", *argv]
    exec(compile(code, "<string>", "exec"), {"__name__": "__main__", "__builtins__": builtins})


class Child:
    """A running child: like `subprocess.Popen([sys.executable, "-c", code, *argv])` with stdout and stderr captured."""

    def __init__(
        self,
        code: str,
        argv: Sequence[object] = (),
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | str | None = None,
    ):
        self.args = [sys.executable, "-c", code, *map(str, argv)]
        self._tmp = tempfile.TemporaryDirectory()
        self._out, self._err = os.path.join(self._tmp.name, "stdout"), os.path.join(self._tmp.name, "stderr")
        child_args = (code, self.args[3:], dict(env or os.environ), str(cwd or os.getcwd()), self._out, self._err)
        self._proc = _server().Process(target=_child, args=child_args)
        self._proc.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def kill(self) -> None:
        self._proc.kill()

    def wait(self, timeout: float | None = None) -> subprocess.CompletedProcess:
        """Its result once it ends; past `timeout` seconds it is killed and subprocess.TimeoutExpired raised."""
        self._proc.join(timeout)
        try:
            if self._proc.exitcode is None:
                self._proc.kill()
                self._proc.join()
                raise subprocess.TimeoutExpired(self.args, timeout)
            # A child that died before it opened them (a failed start) wrote neither.
            out, err = (Path(p).read_text() if os.path.exists(p) else "" for p in (self._out, self._err))
            return subprocess.CompletedProcess(self.args, self._proc.exitcode, out, err)
        finally:
            self._tmp.cleanup()


def run_python(
    code: str,
    argv: Sequence[object] = (),
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | str | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=timeout)`."""
    return Child(code, argv, env=env, cwd=cwd).wait(timeout)


# `python -m speculators_train ARGS...` as a child's code.
CLI = "import sys\nfrom speculators_train.cli import main\nmain(sys.argv[1:])\n"
