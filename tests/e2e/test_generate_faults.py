"""`generate` under kill -9 at its crash windows: the rerun finishes with the shards of an uninterrupted run, bit for
bit, every record exactly once, and a manifest that validates.

Kills are driven by events (a chunk about to be captured, each os.fsync and os.replace of a shard, a progress
file, the token counts and the manifest), so every window is hit on any machine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import pytest

from speculators_train.hidden_states.shards import HiddenStateShards, validate
from tests.children import CLI, Child, run_python
from tests.conftest import REPO, SHAREGPT, make_recipe
from tests.faults import crash_windows, event_labels, run_cli, run_killed
from tests.integration.test_generator import assert_same_shards

SOURCES = [{"name": "sharegpt", "path": SHAREGPT, "max_records": 8}]
GENERATION = {"storage_dtype": "float32", "samples_per_shard": 2, "max_tokens_per_batch": 256}
EVENTS = ["speculators_train.hidden_states.generator:process_chunk"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    labels = event_labels(["generate", make_recipe(tmp, SOURCES, generation=GENERATION)], EVENTS)
    return tmp / "run" / "hidden_states", labels


def test_kill_at_each_crash_window_then_rerun_gives_the_same_shards(tmp_path, reference, capsys):
    """Each kind of event once and the last few (the token counts and the manifest); every event with
    SPECULATORS_TRAIN_FULL=1."""
    expected, labels = reference
    recipe = make_recipe(tmp_path, SOURCES, generation=GENERATION)
    out = tmp_path / "run" / "hidden_states"
    for die_at in crash_windows(labels, tail=4):
        shutil.rmtree(out, ignore_errors=True)
        code, _ = run_killed(die_at, ["generate", recipe], EVENTS)
        where = f"killed at event {die_at} of {len(labels)} ({labels[die_at - 1]})"
        assert code == -signal.SIGKILL, f"{where}: the run ended first"
        code, err = run_cli(["generate", recipe], capsys)
        assert code == 0, f"{where}: {err}"
        assert_same_shards(out, expected)
        assert validate(out) == [], where
        for split in ("train", "held_out"):
            ids = [sample["id"] for sample in HiddenStateShards(out, split)]
            assert len(ids) == len(set(ids)), f"{where}: a record was stored twice"


def test_kill_minus_9_then_rerun_gives_the_same_shards(tmp_path):
    """A kill at whatever moment the run has reached (not an event's): the CLI in a child, killed once two shards
    are recorded."""
    sources = [{"name": "sharegpt", "path": SHAREGPT, "max_records": 32}]
    gen = {"storage_dtype": "float32", "samples_per_shard": 4, "max_tokens_per_batch": 128}
    killed = make_recipe(tmp_path / "killed", sources, generation=gen)
    clean = make_recipe(tmp_path / "clean", sources, generation=gen)
    progress = tmp_path / "killed" / "run" / "hidden_states" / "progress" / "rank000.json"
    proc = Child(CLI, ["generate", killed], cwd=REPO)
    deadline = time.time() + 300
    while time.time() < deadline:
        if progress.is_file() and len(json.loads(progress.read_text())["shards"]["train"]) >= 2:
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "killed" / "run" / "hidden_states" / "manifest.json").exists(), "run ended before the kill"
    run_python(CLI, ["generate", killed], cwd=REPO).check_returncode()
    run_python(CLI, ["generate", clean], cwd=REPO).check_returncode()
    killed_dir = tmp_path / "killed" / "run" / "hidden_states"
    assert_same_shards(killed_dir, tmp_path / "clean" / "run" / "hidden_states")
    assert validate(killed_dir) == []
    ids = [i for s in HiddenStateShards(killed_dir, "train") for i in [s["id"]]]
    assert len(ids) == len(set(ids)), "no record may appear twice"
