"""SIGTERM, as a scheduler, `timeout` or `docker stop` sends it: every stage unwinds as it does on Ctrl-C. The
engine and converter processes it started end with it, its temporary files are removed, it prints one line saying
how to resume and exits 143, and a rerun of the same command finishes.

A child runs the CLI and sends itself SIGTERM at an event (the Nth call of a function, or the moment a file
matching a pattern appears), never after a timer, so the same moment is hit on any machine. At that moment it
records the processes it has started, and the test checks that none of them outlives it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import SHAREGPT, make_recipe, sweep
from tests.faults import REPO, run_cli

# argv: hook ("module:attr" or ""), the call of it to stop at, a glob whose first match stops it (or ""), the file
# the child's process tree is written to at that moment, then the CLI's arguments.
TERMINATOR = r"""
import glob, importlib, json, os, signal, sys, threading, time

import psutil

hook, count, pattern, tree_file = sys.argv[1:5]
delay = float(os.environ.get("TERMINATE_AFTER", "0"))  # seconds after the event: a signal inside a blocking call


def terminate():
    pids = [p.pid for p in psutil.Process().children(recursive=True)]
    with open(tree_file, "w") as fh:
        json.dump(pids, fh)
    os.kill(os.getpid(), getattr(signal, os.environ.get("TERMINATE_SIGNAL", "SIGTERM")))


if hook:
    module, _, attr = hook.partition(":")
    owner_name, _, leaf = attr.rpartition(".")
    owner = importlib.import_module(module)
    for part in filter(None, owner_name.split(".")):
        owner = getattr(owner, part)
    original, seen = getattr(owner, leaf), [0]

    def wrapped(*args, **kwargs):
        seen[0] += 1
        if seen[0] == int(count):
            threading.Timer(delay, terminate).start() if delay else terminate()
        return original(*args, **kwargs)

    setattr(owner, leaf, wrapped)
if pattern:
    def watch():
        while not glob.glob(pattern):
            time.sleep(0.01)
        terminate()

    threading.Thread(target=watch, daemon=True).start()
from speculators_train.cli import main
main(sys.argv[5:])
"""


def terminated(
    tmp_path: Path, argv: list, hook: str = "", count: int = 1, pattern: str = "", after: float = 0, kill: bool = False
) -> list[int]:
    """Run the CLI until SIGTERM (SIGKILL with `kill`) at the event (or `after` seconds past it); assert it ended as
    Ctrl-C does (exit 143, one line on how to resume, no traceback), or was killed, and return the processes it had
    started."""
    tree = tmp_path / "tree.json"
    proc = subprocess.run(
        [sys.executable, "-c", TERMINATOR, hook, str(count), pattern, str(tree), *map(str, argv)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "TERMINATE_AFTER": str(after), "TERMINATE_SIGNAL": "SIGKILL" if kill else "SIGTERM"},
    )
    err = proc.stderr
    if kill:
        assert proc.returncode == -9, f"exit {proc.returncode}:\n{err[-3000:]}"
        return json.loads(tree.read_text())
    assert proc.returncode == 143, f"exit {proc.returncode}:\n{err[-3000:]}"
    assert "terminated (SIGTERM): rerun the same command to resume" in proc.stdout + err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    return json.loads(tree.read_text())


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_ended(pids: list[int]) -> None:
    deadline = time.monotonic() + 20
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [f"{p} {psutil.Process(p).name()}" for p in pids if alive(p)]
    assert not left, f"still running after the toolkit exited: {left}"


def test_generate_stops_between_shards_and_the_rerun_finishes(tmp_path, capsys):
    recipe = make_recipe(tmp_path, [{"name": "sharegpt", "path": SHAREGPT, "max_records": 16}])
    terminated(tmp_path, ["generate", recipe], "speculators_train.hidden_states.generator:process_chunk", count=2)
    code, err = run_cli(["generate", recipe], capsys)
    assert code == 0, err
    assert run_cli(["validate", recipe], capsys)[0] == 0


def test_export_to_gguf_ends_the_converter_and_leaves_no_temporary_file(tmp_path, fitted):
    recipe, checkpoint, _, _ = fitted()
    out = tmp_path / "exports" / "gguf"
    started = terminated(
        tmp_path,
        ["export", recipe.source_path, "--checkpoint", checkpoint, "--format", "gguf", "--out", out],
        pattern=str(out.parent / ".*.tmp-*" / ".*.tmp-*"),  # the converter is writing its output
    )
    assert started, "the converter was not running"
    assert_ended(started)
    assert not out.exists()
    assert not [p for p in out.parent.rglob("*") if ".tmp" in p.name], list(out.parent.rglob("*"))


def test_a_killed_gguf_export_leaves_no_converter_and_its_rerun_no_staging_folder(tmp_path, fitted, capsys):
    """SIGKILL runs no cleanup in the export: its watcher ends the converter, and the rerun removes the killed
    export's staging folder before it writes its own."""
    recipe, checkpoint, _, _ = fitted()
    out = tmp_path / "exports" / "gguf"
    argv = ["export", recipe.source_path, "--checkpoint", checkpoint, "--format", "gguf", "--out", out]
    started = terminated(tmp_path, argv, pattern=str(out.parent / ".*.tmp-*" / ".*.tmp-*"), kill=True)
    assert started, "the converter was not running"
    assert_ended(started)
    assert [p.name for p in out.parent.iterdir() if ".tmp-" in p.name], "the killed export left nothing to clear"
    code, err = run_cli(argv, capsys)
    assert code == 0, err
    assert not [p for p in out.parent.rglob("*") if ".tmp" in p.name], list(out.parent.rglob("*"))


ENGINES = {  # engine: (the recipe settings of a short run, the call at which SIGTERM arrives)
    "llama.cpp": (
        ["eval.num_prompts=1", "eval.max_new_tokens=8", "eval.llama_cpp.targets=[f32]",
         "eval.llama_cpp.speculative_tokens=[1]", "eval.llama_cpp.baselines=[]"],
        "speculators_train.engines.llamacpp.server:Server.complete",
    ),
    "vllm": (
        ["eval.num_prompts=1", "eval.max_new_tokens=8", "eval.vllm.batch=false", "eval.vllm.baselines=[]",
         "eval.vllm.max_model_len=512"],
        "speculators_train.engines.vllm.offline:Engine.generate",
    ),
}  # fmt: skip


# The default run ends llama.cpp's server; vLLM's engine, whose end the test below proves mid-start (the harder
# case), runs here with SPECULATORS_TRAIN_FULL=1 as well.
@pytest.mark.parametrize("engine", sweep(ENGINES, ("llama.cpp",)))
def test_verify_ends_its_engine_processes(tmp_path, fitted, engine):
    if engine == "vllm":
        pytest.importorskip("vllm")
    recipe, checkpoint, _, _ = fitted()
    settings, hook = ENGINES[engine]
    argv = ["verify", recipe.source_path, "--draft", checkpoint, "--engine", engine, "--out", tmp_path / "v"]
    started = terminated(tmp_path, [*argv, *(x for s in settings for x in ("--set", s))], hook)
    assert started, f"no {engine} process was running"
    assert_ended(started)


def test_sigterm_while_vllm_starts_ends_the_command_and_its_engine(tmp_path, fitted):
    """SIGTERM two seconds into vLLM's wait for its engine core (a ZeroMQ poll that drops a handler's exception) ends
    `verify` within seconds, with the half-started engine's processes: before, the command ran until the engine was
    up and then went on as if nothing had been sent."""
    pytest.importorskip("vllm")
    recipe, checkpoint, _, _ = fitted()
    settings, _ = ENGINES["vllm"]
    argv = ["verify", recipe.source_path, "--draft", checkpoint, "--engine", "vllm", "--out", tmp_path / "v"]
    start = time.monotonic()
    started = terminated(
        tmp_path,
        [*argv, *(x for s in settings for x in ("--set", s))],
        "vllm.v1.engine.utils:wait_for_engine_startup",
        after=2,
    )
    assert time.monotonic() - start < 120
    assert started, "no vLLM process was running"
    assert_ended(started)
