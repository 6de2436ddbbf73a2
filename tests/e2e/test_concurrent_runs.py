"""Two processes on one run: the second is refused with one line naming the first, before it touches anything,
and a lock left by a killed process never blocks the rerun."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SHAREGPT, make_recipe
from tests.faults import REPO, clean_error, run_cli

# Holds the lock of argv[1] as stage argv[2] until killed; says so on stdout once it holds it.
HOLDER = """
import sys, time
from pathlib import Path
from speculators_train.runlock import exclusive
with exclusive(Path(sys.argv[1]), sys.argv[2]):
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.fixture
def holder():
    """Start a process holding a directory's lock; every one started is killed at the end."""
    started: list[subprocess.Popen] = []

    def hold(directory: Path, stage: str) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(directory), stage], cwd=REPO, stdout=subprocess.PIPE, text=True
        )
        started.append(proc)
        assert proc.stdout.readline().strip() == "held"
        return proc

    yield hold
    for proc in started:
        proc.kill()
        proc.wait()


def chats(tmp_path: Path) -> Path:
    logs = tmp_path / "logs"
    logs.mkdir()
    record = {"id": "r0", "messages": [{"role": "user", "content": "Sort a list?"}], "response": "Use sorted()."}
    (logs / "a.jsonl").write_text(json.dumps(record) + "\n")
    return logs


@pytest.mark.parametrize(
    ("stage", "directory", "argv"),
    [
        ("generate", "hidden_states", []),
        ("train", "train", []),
        ("osd", "osd", ["--ingest-only", "--logs", "{logs}"]),
        ("export", "export/speculators", []),
    ],
)
def test_a_second_process_on_a_run_is_refused_with_the_holder_named(tmp_path, capsys, holder, stage, directory, argv):
    recipe = make_recipe(tmp_path, [{"name": "sharegpt", "path": SHAREGPT, "max_records": 4}])
    logs = chats(tmp_path)
    first = holder(tmp_path / "run" / directory, stage)
    args = [a.format(logs=logs) for a in argv]
    text = clean_error([stage, recipe, *args], capsys, f"is in use by process {first.pid} on", f"({stage}, since")
    assert "wait for it to finish or stop it, then rerun" in text
    assert not (tmp_path / "run" / directory).exists()  # refused before anything was written


def test_a_lock_left_by_a_killed_process_does_not_block_the_rerun(tmp_path, capsys, holder):
    recipe = make_recipe(tmp_path, [{"name": "sharegpt", "path": SHAREGPT, "max_records": 4}])
    logs = chats(tmp_path)
    first = holder(tmp_path / "run" / "osd", "osd")
    clean_error(["osd", recipe, "--ingest-only", "--logs", logs], capsys, f"process {first.pid}")
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    code, err = run_cli(["osd", recipe, "--ingest-only", "--logs", logs], capsys)
    assert code == 0, err
    assert "ingested 1 new records" in " ".join(err.split())


def test_two_runs_whose_stage_directories_link_to_one_directory_share_its_lock(tmp_path, capsys, holder):
    """The lock is the directory's, not its path's: a run whose `train/` is a link to a directory another run
    trains in (states or checkpoints kept on another disk) is refused."""
    shared = tmp_path / "disk" / "train"
    shared.mkdir(parents=True)
    recipes = []
    for name in ("one", "two"):
        recipes.append(make_recipe(tmp_path / name, [{"name": "sharegpt", "path": SHAREGPT, "max_records": 4}]))
        (tmp_path / name / "run").mkdir()
        (tmp_path / name / "run" / "train").symlink_to(shared, target_is_directory=True)
    first = holder(tmp_path / "one" / "run" / "train", "train")
    clean_error(["train", recipes[1]], capsys, f"is in use by process {first.pid} on", "(train, since")
    assert not list(shared.iterdir())


def test_a_stray_rank_in_the_environment_still_takes_the_lock(tmp_path, capsys, holder, monkeypatch):
    """Only a process group says a process is a secondary rank: with `RANK=1` left in the environment of single
    processes, the holder takes the lock and the second process is refused."""
    monkeypatch.setenv("RANK", "1")
    recipe = make_recipe(tmp_path, [{"name": "sharegpt", "path": SHAREGPT, "max_records": 4}])
    first = holder(tmp_path / "run" / "train", "train")
    clean_error(["train", recipe], capsys, f"is in use by process {first.pid} on")
