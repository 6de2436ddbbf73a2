"""`train` under kill -9 at its crash windows, on damaged shards and checkpoints, and on a full disk.

A kill is driven by events (the Nth os.replace / os.fsync / validation / metrics line of the run), never by a
timer, so the same window is hit on any machine. After the kills a plain rerun must finish with the loss curve of
an uninterrupted run, one metrics line per step and validation, held-out metrics, and best.json.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.conftest import SHAREGPT, make_recipe
from tests.faults import clean_error, crash_windows, event_labels, mount_tmpfs, run_cli, run_killed

TRAIN = {
    "epochs": 2,
    "batch_size": 4,
    "learning_rate": 3e-3,
    "warmup_ratio": 0.0,
    "log_every_steps": 1,
    "save_every_steps": 2,
    "eval_every_steps": 5,
    "keep_last": 1,
    "wandb": {"mode": "disabled"},
}
DRAFT = {"family": "eagle3", "draft_vocab_size": 512, "ttt_steps": 2}
# Besides every os.replace and os.fsync: a validation, and a metrics line about to be appended.
EVENTS = ["speculators_train.training.trainer:Trainer._evaluate", "speculators_train.training.trainer:Trainer._log"]


def run_dir(tmp_path: Path, states: Path, **training) -> Path:
    recipe = make_recipe(
        tmp_path,
        [{"name": "sharegpt", "path": SHAREGPT, "max_records": 20}],
        training={**TRAIN, **training},
        draft=DRAFT,
    )
    shutil.copytree(states, tmp_path / "run" / "hidden_states")
    return recipe


def records(tmp_path: Path) -> list[dict]:
    return [json.loads(x) for x in (tmp_path / "run" / "train" / "metrics.jsonl").read_text().splitlines()]


def curve(tmp_path: Path) -> dict[tuple[str, int], float]:
    """(kind, step) -> loss or predicted AL, asserting each step is logged once per kind."""
    seen = Counter(("val" if any(k.startswith("val/") for k in r) else "train", r["step"]) for r in records(tmp_path))
    assert max(seen.values()) == 1, f"metrics lines repeated: {[k for k, n in seen.items() if n > 1]}"
    out = {}
    for r in records(tmp_path):
        if "loss" in r:
            out[("train", r["step"])] = r["loss"]
        else:
            out[("val", r["step"])] = next(v for k, v in r.items() if k.startswith("val/predicted_al"))
    return out


# The crash sweep's run: one epoch of 3 steps still passes every kind of event (a save per step, a validation
# inside the epoch and one at its end, best.json, the final save replacing the step's own); resuming across epochs
# is test_train.py's killed-run test.
SWEEP = {"epochs": 1, "save_every_steps": 1, "eval_every_steps": 2}


def uninterrupted(tmp: Path, states: Path, **training) -> tuple[dict, str, list[str]]:
    """A run to its end: its curve, best.json and the events it passes through."""
    labels = event_labels(["train", run_dir(tmp, states, **training)], EVENTS)
    return curve(tmp), (tmp / "run" / "train" / "checkpoints" / "best.json").read_text(), labels


def test_kill_at_each_crash_window_resumes_to_the_same_curve(tmp_path, states, capsys):
    """SIGKILL at one event of the run (each kind of event once, and the last four: the final checkpoint's commit;
    every event with SPECULATORS_TRAIN_FULL=1), then the same command: it finishes on the
    uninterrupted curve, with one metrics line per step and validation, and the same best checkpoint."""
    expected, best, labels = uninterrupted(tmp_path / "reference", states, **SWEEP)
    assert {"Trainer._evaluate _stepped", "Trainer._evaluate _finish_step", "os.replace best.json"} <= set(labels)
    assert "os.replace .step-N.old-N" in labels
    recipe = run_dir(tmp_path, states, **SWEEP)
    for die_at in crash_windows(labels, tail=4):
        shutil.rmtree(tmp_path / "run" / "train", ignore_errors=True)
        code, _ = run_killed(die_at, ["train", recipe], EVENTS)
        where = f"killed at event {die_at} of {len(labels)} ({labels[die_at - 1]})"
        assert code == -signal.SIGKILL, f"{where}: the run ended first"
        code, err = run_cli(["train", recipe], capsys)
        assert code == 0, f"{where}: {err}"
        assert curve(tmp_path) == pytest.approx(expected, rel=1e-6), where
        assert (tmp_path / "run" / "train" / "checkpoints" / "best.json").read_text() == best, where


def test_rerun_of_a_finished_run_reports_again_without_new_lines(tmp_path, states, capsys):
    recipe = run_dir(tmp_path, states, epochs=1, save_every_steps=None, eval_every_steps=None)
    assert run_cli(["train", recipe], capsys)[0] == 0
    before = records(tmp_path)
    with open(tmp_path / "run" / "train" / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 9, "lo')  # a line cut by a kill
    code, err = run_cli(["train", recipe], capsys)
    assert code == 0, err
    assert records(tmp_path) == before
    assert "predicted acceptance length" in " ".join(err.split())


def flip(path: Path, tensor: str, byte: int = 0) -> None:
    """Flip one byte inside one tensor's data of a safetensors file."""
    with safe_open(path, framework="pt") as fh:
        names = list(fh.keys())
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8 : 8 + header_len])
    start = 8 + header_len + header[tensor]["data_offsets"][0] + byte
    data = bytearray(path.read_bytes())
    data[start] ^= 0x40
    path.write_bytes(bytes(data))
    assert tensor in names


@pytest.mark.parametrize("tensor", ["aux_hidden_states", "hidden_state", "offsets", "input_ids", "loss_mask"])
def test_a_flipped_byte_in_any_shard_tensor_is_refused_by_train(tmp_path, states, capsys, tensor):
    recipe = run_dir(tmp_path, states)
    shard = sorted((tmp_path / "run" / "hidden_states" / "train").glob("*.safetensors"))[0]
    flip(shard, tensor, byte=1 if tensor != "offsets" else 8)
    # Refused at the first touch of the damaged shard, before any of its samples is used.
    clean_error(["train", recipe], capsys, shard.name, "speculators-train validate")


def test_damaged_token_counts_are_refused(tmp_path, states, capsys):
    recipe = run_dir(tmp_path, states)
    flip(tmp_path / "run" / "hidden_states" / "token_freq.safetensors", "token_freq", byte=5)
    clean_error(["train", recipe], capsys, "token_freq.safetensors", "checksum mismatch")


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("optimizer.pt", b"\x80\x04garbage", "optimizer state"),
        ("optimizer.pt", b"", "optimizer state"),
        ("trainer_state.json", b'{"step": ', "trainer state is not valid JSON"),
        ("trainer_state.json", b"[1, 2]", "trainer state must be a JSON object"),
        ("model.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{}", "model.safetensors"),
    ],
    ids=["optimizer-garbage", "optimizer-empty", "state-truncated", "state-not-object", "weights-garbage"],
)
def test_a_damaged_checkpoint_is_one_line(tmp_path, states, capsys, name, content, needle):
    recipe = run_dir(tmp_path, states, epochs=1, max_steps=2, eval_every_steps=None)
    assert run_cli(["train", recipe], capsys)[0] == 0
    (tmp_path / "run" / "train" / "checkpoints" / "step-000002" / name).write_bytes(content)
    shutil.rmtree(tmp_path / "run" / "train" / "checkpoints" / "step-000001", ignore_errors=True)
    clean_error(["train", recipe, "--set", "training.max_steps=4"], capsys, "step-000002", needle)


def test_an_optimizer_state_of_another_shape_is_one_line(tmp_path, states, capsys):
    recipe = run_dir(tmp_path, states, epochs=1, max_steps=2, eval_every_steps=None)
    assert run_cli(["train", recipe], capsys)[0] == 0
    import torch

    path = tmp_path / "run" / "train" / "checkpoints" / "step-000002" / "optimizer.pt"
    state = torch.load(path, weights_only=True)
    state["optimizer"]["param_groups"] = state["optimizer"]["param_groups"] * 2
    torch.save(state, path)
    clean_error(["train", recipe, "--set", "training.max_steps=4"], capsys, "checkpoint does not fit this run")


def test_a_full_disk_during_a_checkpoint_is_one_line_and_resumes_exactly(tmp_path, states, capsys):
    """Checkpoints go to a real tmpfs big enough for one of them, not two: the second save fails on ENOSPC (torch
    and safetensors raise their own exception types there), the run stops with one line, and once space is
    freed the same command resumes on the uninterrupted curve."""
    expected, _, _ = uninterrupted(tmp_path / "reference", states)
    recipe = run_dir(tmp_path, states)
    probe = tmp_path / "probe"
    assert run_cli(["train", run_dir(probe, states, epochs=1, max_steps=1)], capsys)[0] == 0
    one = sum(f.stat().st_size for f in (probe / "run" / "train" / "checkpoints").rglob("*") if f.is_file())
    disk = tmp_path / "run" / "train" / "checkpoints"
    if not mount_tmpfs(disk, one + one // 2):
        pytest.skip("cannot mount a tmpfs here (needs root); the full-disk path is covered where it can")
    try:
        text = clean_error(["train", recipe], capsys, "disk full while writing", "rerun the same command to resume")
        assert "step-000003" in text  # the epoch-end save after step 2's
        saved = {p.name for p in disk.iterdir()}
        assert "step-000002" in saved and not any(n.startswith(".step-") for n in saved), saved
        kept = tmp_path / "kept"
        shutil.copytree(disk, kept)
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    shutil.rmtree(disk)
    shutil.copytree(kept, disk)
    code, err = run_cli(["train", recipe], capsys)
    assert code == 0, err
    assert curve(tmp_path) == pytest.approx(expected, rel=1e-6)


def strict(line: str) -> dict:
    """One JSON line as a strict reader takes it: `NaN` and `Infinity` are not JSON."""

    def refuse(constant: str) -> None:
        raise ValueError(f"non-JSON constant {constant}")

    return json.loads(line, parse_constant=refuse)


def test_a_loss_that_is_not_a_number_stops_the_run_and_nothing_poisoned_is_kept(tmp_path, states, capsys):
    """A learning rate this large overflows the weights after step 1: the run stops at the first non-finite loss,
    names the last good checkpoint, logs strict JSON, and neither export nor verify takes a poisoned draft."""
    import torch
    from safetensors.torch import load_file, save_file

    recipe = run_dir(tmp_path, states, learning_rate=1e30, save_every_steps=1, eval_every_steps=None)
    text = clean_error(["train", recipe], capsys, "the training loss is", "training stopped and saved nothing after it")
    checkpoints = tmp_path / "run" / "train" / "checkpoints"
    assert f"the last good checkpoint is {checkpoints / 'step-000001'}" in text, text
    assert not (checkpoints / "best.json").exists()
    for weights in checkpoints.glob("step-*/model.safetensors"):
        assert all(torch.isfinite(t).all() for t in load_file(weights).values()), weights
    lines = (tmp_path / "run" / "train" / "metrics.jsonl").read_text().splitlines()
    assert [strict(line)["step"] for line in lines] == [1]

    weights = checkpoints / "step-000001" / "model.safetensors"
    tensors = load_file(weights)
    name = next(k for k in sorted(tensors) if tensors[k].is_floating_point())
    tensors[name][0] = float("nan")
    save_file(tensors, weights)
    out = tmp_path / "export"
    clean_error(["export", recipe, "--checkpoint", checkpoints, "--out", out], capsys, name, "non-finite values")
    assert not out.exists()
    clean_error(["verify", recipe, "--draft", checkpoints], capsys, name, "non-finite values")


def test_wandb_online_without_a_key_is_one_line(tmp_path, states, capsys, monkeypatch):
    from speculators_train.origin import cache_root

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("SPECULATORS_TRAIN_CACHE", str(cache_root()))  # the target's converted copy, not rebuilt
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc holding a key
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    recipe = run_dir(tmp_path, states, wandb={"mode": "online"})
    clean_error(["train", recipe], capsys, "training.wandb.mode 'online'", "set training.wandb.mode: offline")


def test_a_recipe_typo_under_accelerate_launch_ends_on_one_error_line(tmp_path):
    """Through accelerate's own launcher (`--quiet`, as the docs write it): the child's `error:` line, accelerate's
    exit status, no traceback from either process."""
    import sys

    recipe = tmp_path / "typo.yaml"
    recipe.write_text("name: t\ntrainig: {}\n")
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--quiet", "--cpu", "--num_processes", "1"]
    proc = subprocess.run([*launch, "-m", "speculators_train", "train", str(recipe)], capture_output=True, text=True)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert f"{recipe}: trainig: unknown key" in proc.stderr
