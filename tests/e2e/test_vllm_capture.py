"""Hidden states captured by vLLM (`generation.engine: vllm`) against the transformers capture, on the real target
and real ShareGPT records: a capture killed -9 and rerun gives the same shards and manifest, states equal within
fp32 rounding and the same trained draft."""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch

from speculators_train.engines.vllm import offline as vllm
from speculators_train.hidden_states.shards import HiddenStateShards, read_manifest, validate
from speculators_train.recipe import load_recipe
from speculators_train.training.trainer import Trainer
from tests.conftest import SHAREGPT, full_only, make_recipe
from tests.e2e.test_train import run_recipe
from tests.faults import clean_error, run_killed

SOURCES = [{"name": "sharegpt", "path": SHAREGPT, "max_records": 20}]  # the records of the session's `states`
VLLM = {"engine": "vllm"}


# --- the recipe and the engine's environment (no engine started) ------------------------------------------------


def test_recipe_refuses_vllm_capture_where_it_cannot_serve(tmp_path, capsys):
    online = make_recipe(tmp_path / "a", SOURCES, generation={**VLLM, "hidden_states": "online"})
    clean_error(["data", online], capsys, "generation.engine 'vllm' writes stored shards")
    regen = make_recipe(tmp_path / "b", SOURCES, generation=VLLM)
    clean_error(
        ["data", regen, "--set", "data.regenerate.enabled=true"], capsys, "data.regenerate.engine 'transformers'"
    )
    split = make_recipe(tmp_path / "c", SOURCES, generation={"tensor_parallel_size": 2})
    clean_error(["data", split], capsys, "generation.tensor_parallel_size: only generation.engine 'vllm'")


def test_the_engine_starts_without_the_launchers_variables_and_they_come_back(tmp_path, monkeypatch):
    """vLLM reads LOCAL_RANK and the rendezvous variables as its own (which rank is first on a machine, env://
    init); under torchrun they describe this process's group, so each rank's engine starts without them."""
    from speculators_train.hidden_states.vllm_capture import LAUNCHER_VARIABLES, VllmCapture
    from speculators_train.target import load_target

    recipe = load_recipe(make_recipe(tmp_path, SOURCES, generation=VLLM))
    capture = VllmCapture(recipe, load_target(recipe.target, weights=False), rank=1, local_rank=0)  # not started
    overrides = capture.engine.env[-1]
    assert {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"} <= set(LAUNCHER_VARIABLES)
    assert all(overrides[name] is None for name in LAUNCHER_VARIABLES)
    assert capture.spool == (recipe.hidden_states_dir / ".vllm-rank001").resolve()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    with vllm._environment(1, None, False, {**overrides, "CUDA_VISIBLE_DEVICES": "2,3"}):
        assert "RANK" not in os.environ and "MASTER_PORT" not in os.environ
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert os.environ["RANK"] == "1" and os.environ["MASTER_PORT"] == "29500"
    assert os.environ.get("CUDA_VISIBLE_DEVICES") != "2,3"


# --- the real engine ---------------------------------------------------------------------------------------------


EVENTS = ["speculators_train.hidden_states.generator:process_chunk"]


@dataclass
class Capture:
    states: Path  # the rerun's shards
    killed: int  # the killed run's exit code
    outlived: list  # vLLM engine processes still running after the killed run
    spool: bool  # the killed engine's spool was on disk before the rerun
    rerun: tuple[int, str]  # the rerun's exit code and standard error


@pytest.fixture(scope="module")
def captured(tmp_path_factory) -> Capture:
    """The session's 20 records captured by vLLM, run by the CLI in a child killed -9 as it starts its second chunk
    (the first shard being written), then rerun to the end: two engine starts for the module. The tests compare
    what the rerun stored with the transformers capture, so a resume that stored a record twice, lost one or
    shifted a shard fails there."""
    recipe = make_recipe(tmp_path_factory.mktemp("vllm"), SOURCES, generation=VLLM)
    before = {p.pid for p in psutil.process_iter()}
    killed, _ = run_killed("2@process_chunk", ["generate", recipe], EVENTS)
    left = [p for p in psutil.process_iter(["pid", "name"]) if p.pid not in before and "VLLM" in (p.name() or "")]
    psutil.wait_procs(left, timeout=30)
    out = load_recipe(recipe).hidden_states_dir
    spool = bool(list(out.glob(".vllm*")))
    rerun = run_killed(0, ["generate", recipe], EVENTS)
    return Capture(out, killed, [p for p in left if p.is_running()], spool, rerun)


@pytest.fixture(scope="module")
def vllm_states(captured) -> Path:
    assert captured.rerun[0] == 0, captured.rerun[1][-3000:]
    return captured.states


def assert_same_states(a: dict, b: dict) -> None:
    """Sample `a` holds `b`'s tokens and its states up to float rounding of another kernel library (measured up to
    1e-5 of a row's largest magnitude); a wrong layer or an offset of one position is off by the row's whole scale."""
    assert a["id"] == b["id"] and torch.equal(a["input_ids"], b["input_ids"]), (a["id"], b["id"])
    for key in ("aux_hidden_states", "hidden_state"):
        assert a[key].shape == b[key].shape, (a["id"], key)
        error = ((a[key] - b[key]).abs().amax(-1) / b[key].abs().amax(-1).clamp_min(1e-6)).max().item()
        assert error < 1e-3, (a["id"], key, error)


def test_vllm_states_equal_the_transformers_states_in_the_same_shards(vllm_states, states):
    ours, theirs = read_manifest(vllm_states), read_manifest(states)
    assert ours["identity"].pop("capture_engine") == "vllm" and "capture_engine" not in theirs["identity"]
    assert ours["identity"] == theirs["identity"]
    assert validate(vllm_states) == []
    for split in ("train", "held_out"):
        counts = [
            {k: e[k] for k in ("file", "num_samples", "num_tokens", "num_loss_tokens")}
            for e in ours["splits"][split]["shards"]
        ]
        assert counts == [{k: e[k] for k in counts[0]} for e in theirs["splits"][split]["shards"]]
        pairs = list(zip(HiddenStateShards(vllm_states, split), HiddenStateShards(states, split), strict=True))
        assert pairs, split
        for a, b in pairs:
            assert_same_states(a, b)
            assert torch.equal(a["loss_mask"], b["loss_mask"])
    assert not list(vllm_states.glob(".vllm*")), "the engine's spool was left behind"


def test_a_draft_trained_on_either_capture_has_the_same_held_out_metrics(tmp_path, vllm_states, states):
    metrics = []
    for name, stored in (("transformers", states), ("vllm", vllm_states)):
        recipe = load_recipe(run_recipe(tmp_path / name, stored, training={"max_steps": 6, "eval_every_steps": 6}))
        Trainer(recipe).train()
        lines = (recipe.run_dir / "train" / "metrics.jsonl").read_text().splitlines()
        held_out = [json.loads(x) for x in lines if "val/loss" in x]
        assert held_out, name
        metrics.append({k: v for k, v in held_out[-1].items() if k.startswith("val/")})
    assert metrics[0].keys() == metrics[1].keys()
    for key in metrics[0]:
        assert metrics[1][key] == pytest.approx(metrics[0][key], rel=1e-3, abs=1e-4), key


def test_kill_9_during_vllm_capture_ends_its_engine_and_the_rerun_stores_each_record_once(captured, vllm_states):
    """vLLM's engine process does not outlive the killed run, whose spool the rerun clears; the rerun's states are
    the transformers capture's (`test_vllm_states_equal_the_transformers_states_in_the_same_shards`)."""
    assert captured.killed == -signal.SIGKILL, "the run ended before its second chunk"
    assert not captured.outlived, "vLLM's engine outlived the killed run"
    assert captured.spool and not list(vllm_states.glob(".vllm*"))
    assert validate(vllm_states) == []
    for split in ("train", "held_out"):
        ids = [sample["id"] for sample in HiddenStateShards(vllm_states, split)]
        assert ids and len(ids) == len(set(ids)), split


@full_only
def test_two_nodes_each_capture_with_an_engine_of_their_own(tmp_path, states):
    """The multi-node `generate` with `generation.engine: vllm`: each launcher's rank starts its own vLLM
    engine and writes its own shards; together they hold every record with the states one transformers process
    captures. In the full run only: by default two nodes generate with transformers
    (tests/e2e/test_distributed.py) and vLLM's capture equals transformers' states in one process (above)."""
    from tests.e2e.test_distributed import two_nodes

    recipe = make_recipe(tmp_path, SOURCES, generation=VLLM)
    two_nodes("generate", recipe)
    out = tmp_path / "run" / "hidden_states"
    assert validate(out) == [] and read_manifest(out)["identity"]["world_size"] == 2
    files = {p.name for p in (out / "train").glob("*.safetensors")}
    assert any("-r000-" in f for f in files) and any("-r001-" in f for f in files)
    for split in ("train", "held_out"):
        one = {s["id"]: s for s in HiddenStateShards(states, split)}
        both = {s["id"]: s for s in HiddenStateShards(out, split)}
        assert both.keys() == one.keys()
        for key, sample in both.items():
            assert_same_states(sample, one[key])
