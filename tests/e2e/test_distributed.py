"""Beyond one process, with the real target and its stored states: FSDP2 through accelerate's plugin on two CPU
ranks (gloo) gives one rank's losses, a sharded checkpoint that survives kill -9 and resumes on the same curve, and
the same export; two "nodes" (two torchrun launchers rendezvousing on 127.0.0.1) generate and train as one node;
two ranks generate what one rank does."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from speculators_train.hidden_states.shards import HiddenStateShards, read_manifest, validate
from speculators_train.layout import shard_name
from speculators_train.recipe import load_recipe
from tests.conftest import REPO, SHAREGPT, make_recipe
from tests.e2e.test_train import (  # noqa: F401 (single_rank_losses and single_rank_run: fixtures)
    EAGLE3,
    TRAIN,
    assert_resumed_on_the_same_curve,
    losses,
    run_recipe,
    single_rank_losses,
    single_rank_run,
    two_ranks,
)

FSDP = {"epochs": 2, "batch_size": 2, "save_every_steps": 1, "keep_last": 10, "fsdp": {}}


def launch_two_ranks(recipe: Path) -> subprocess.Popen:
    """torchrun with two CPU ranks, in the background."""
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "speculators_train"]
    return subprocess.Popen(
        [*command, "train", str(recipe)],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def kill_9_all(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process under it at once, as a node that dies takes them all (torchrun starts
    its ranks in sessions of their own, so its process group alone would leave them running)."""
    import psutil

    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in tree:
        p.kill()
    psutil.wait_procs(tree, timeout=30)
    proc.wait()


def test_fsdp2_on_two_cpu_ranks_trains_like_one_rank_and_resumes_after_kill_9(
    tmp_path,
    states,
    single_rank_losses,  # noqa: F811 (the fixture imported above)
):
    clean = run_recipe(tmp_path / "clean", states, training=FSDP)
    two_ranks(clean)
    full = losses(tmp_path / "clean" / "run")
    assert full.keys() == single_rank_losses.keys() and len(full) >= 4
    for step, expected in single_rank_losses.items():
        assert full[step] == pytest.approx(expected, rel=1e-4), f"step {step}"

    # The checkpoint: the whole draft in model.safetensors, each rank's half of the Adam moments in its own file.
    step3 = tmp_path / "clean" / "run" / "train" / "checkpoints" / "step-000003"
    fc = load_file(step3 / "model.safetensors")["fc.weight"]
    halves = [torch.load(step3 / f"optimizer-rank{r:05d}-of-00002.pt", weights_only=True) for r in range(2)]
    moments = torch.cat([h["fc.weight"]["exp_avg"] for h in halves])
    assert moments.shape == fc.shape and all(h["fc.weight"]["exp_avg"].shape[0] < fc.shape[0] for h in halves)
    assert float(halves[0]["fc.weight"]["step"]) == 3.0 and moments.abs().sum() > 0

    killed = run_recipe(tmp_path / "killed", states, training=FSDP)
    latest = tmp_path / "killed" / "run" / "train" / "checkpoints" / "latest.json"
    proc = launch_two_ranks(killed)
    deadline = time.time() + 300
    while time.time() < deadline and not (latest.is_file() and json.loads(latest.read_text())["step"] >= 3):
        time.sleep(0.05)
    kill_9_all(proc)
    assert json.loads(latest.read_text())["step"] < max(full), "the run finished before it was killed"
    two_ranks(killed)
    assert_resumed_on_the_same_curve(tmp_path / "clean" / "run", tmp_path / "killed" / "run")


def test_fsdp2_in_one_process_trains_like_plain_training(tmp_path, states, single_rank_losses):  # noqa: F811
    """No launcher: the trainer makes its own one-rank group, and FSDP2 over it is the plain run."""
    from tests.children import CLI, run_python

    one = run_recipe(tmp_path, states, training={"epochs": 2, "batch_size": 4, "fsdp": {}})
    run_python(CLI, ["train", one], cwd=REPO).check_returncode()
    got = losses(tmp_path / "run")
    assert got.keys() == single_rank_losses.keys()
    for step, expected in single_rank_losses.items():
        assert got[step] == pytest.approx(expected, rel=1e-5), f"step {step}"
    assert (tmp_path / "run" / "train" / "checkpoints" / f"step-{max(got):06d}" / shard_name(0, 1)).is_file()


def test_every_family_trains_under_fsdp2_like_one_rank_and_exports_the_same_draft(tmp_path, states):
    """One launch of two FSDP2 ranks trains a small draft of each family for three steps; one process trains the
    same drafts with the same global batch. Losses agree at every step, and the exports (float32, so no rounding
    of near-equal weights can differ) have the same files, configs and tensors. P-EAGLE trains one depth and the
    block drafts keep every anchor: past depth 1 P-EAGLE's chains, and a block draft's anchors, are drawn from each
    rank's own generator, a draw one rank cannot repeat (FSDP2 and DDP agree there: 2 ranks give the same losses
    either way). The default run trains DFlash alone (a family other than the EAGLE-3 of the tests above, with
    anchors and a block); SPECULATORS_TRAIN_FULL=1 trains every family in the one launch."""
    from speculators_train.export.run import export
    from speculators_train.families import FAMILIES, get
    from speculators_train.recipe import load_recipe
    from speculators_train.training.trainer import Trainer
    from tests.conftest import FIT_SETTINGS, sweep

    assert set(FIT_SETTINGS) == set(FAMILIES)
    budget = {"epochs": 1, "max_steps": 3, "learning_rate": 1e-3}
    one, two = {}, {}
    every_sample = {"peagle": {"depths": 1}}
    trained = sweep(FIT_SETTINGS, ("dflash",))
    for family in trained:
        draft = {"family": family, **FIT_SETTINGS[family], **every_sample.get(family, {})}
        if "max_anchors" in get(family).settings.model_fields:  # a block draft: every anchor, none drawn
            draft["max_anchors"] = 512
        one[family] = run_recipe(tmp_path / family / "one", states, training=budget, draft=draft)
        two[family] = run_recipe(
            tmp_path / family / "two", states, training={**budget, "batch_size": 2, "fsdp": {}}, draft=draft
        )
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "tests.train_many"]
    result = subprocess.run([*command, *map(str, two.values())], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    for family in trained:
        Trainer(load_recipe(one[family])).train()
        expected, got = losses(tmp_path / family / "one" / "run"), losses(tmp_path / family / "two" / "run")
        assert got.keys() == expected.keys() == {1, 2, 3}, family
        for step in expected:
            assert got[step] == pytest.approx(expected[step], rel=1e-4), f"{family} step {step}"
        a = export(load_recipe(one[family]), None, None, tmp_path / family / "one-export", "float32").path
        b = export(load_recipe(two[family]), None, None, tmp_path / family / "two-export", "float32").path
        files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
        assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file()), family
        for name in files:
            if name.suffix == ".json":
                assert json.loads((a / name).read_text()) == json.loads((b / name).read_text()), f"{family} {name}"
            elif name.suffix == ".safetensors":
                x, y = load_file(a / name), load_file(b / name)
                assert x.keys() == y.keys(), f"{family} {name}"
                for key in x:
                    assert x[key].dtype == y[key].dtype and x[key].shape == y[key].shape, f"{family} {key}"
                    if not x[key].is_floating_point():
                        assert torch.equal(x[key], y[key]), f"{family} {key}"
                        continue
                    # As a whole: Adam moves a weight whose gradient is float noise by a full step either way.
                    diff = float((x[key] - y[key]).norm() / x[key].norm().clamp(min=1e-12))
                    assert diff < 1e-4, f"{family} {key}: relative difference {diff:.2e}"


def two_nodes(stage: str, recipe: Path) -> None:
    """The multi-node commands of docs/guide/stages.md on one machine: two torchrun launchers (`--nnodes 2`, one
    rank each), the first node's address and port as the rendezvous, started at once as on two hosts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1"]
    rendezvous = ["--master_addr", "127.0.0.1", "--master_port", str(port)]
    command = ["-m", "speculators_train", stage, str(recipe)]
    nodes = [[*launcher, "--node_rank", str(rank), *rendezvous, *command] for rank in range(2)]
    procs = [subprocess.Popen(c, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True) for c in nodes]
    errors = [p.communicate(timeout=600)[1] for p in procs]
    for proc, err in zip(procs, errors, strict=True):
        assert proc.returncode == 0, err[-3000:]


def test_two_nodes_generate_and_train_as_one_node_of_two_ranks(tmp_path, states):
    """Each node writes its own shards (rank 1's on the second node) and the states equal one process's; training
    over them on two nodes gives the losses of one node with two ranks over the same states (the order of samples
    follows the shards, so the comparison trains on these states, not the session's one-rank ones)."""
    from speculators_train.hidden_states.shards import HiddenStateShards
    from tests.conftest import SHAREGPT, make_recipe

    sources = [{"name": "sharegpt", "path": SHAREGPT, "max_records": 20}]
    recipe = make_recipe(tmp_path, sources, training={**TRAIN, "epochs": 2, "batch_size": 2}, draft=EAGLE3)
    two_nodes("generate", recipe)
    directory = tmp_path / "run" / "hidden_states"
    files = {p.name for p in (directory / "train").glob("*.safetensors")}
    assert any("-r000-" in f for f in files) and any("-r001-" in f for f in files)
    one = {s["id"]: s for s in HiddenStateShards(states, "train")}
    both = {s["id"]: s for s in HiddenStateShards(directory, "train")}
    assert both.keys() == one.keys()
    for key, sample in both.items():
        torch.testing.assert_close(sample["aux_hidden_states"], one[key]["aux_hidden_states"], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(sample["hidden_state"], one[key]["hidden_state"], rtol=1e-4, atol=1e-4)

    two_nodes("train", recipe)
    got = losses(tmp_path / "run")
    one_node = run_recipe(tmp_path / "one-node", directory, training={"epochs": 2, "batch_size": 2})
    two_ranks(one_node)
    expected = losses(tmp_path / "one-node" / "run")
    assert got.keys() == expected.keys() and len(got) >= 4
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-6), f"step {step}"


def test_two_rank_generation_matches_one_rank(states, tmp_path):
    """torchrun's two ranks store the states one rank stores (the session's), each rank its own shards."""
    recipe, manifest = load_recipe(states.parent.parent / "recipe.yaml"), read_manifest(states)
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    two = make_recipe(tmp_path, [{"name": "sharegpt", "path": SHAREGPT, "max_records": 20}])
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "speculators_train"]
    result = subprocess.run([*torchrun, "generate", str(two)], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    directory = tmp_path / "run" / "hidden_states"
    assert validate(directory) == []
    files = {p.name for p in (directory / "train").glob("*.safetensors")}
    assert any("-r000-" in f for f in files) and any("-r001-" in f for f in files)
    one = {s["id"]: s for s in HiddenStateShards(recipe.hidden_states_dir, "train")}
    both = {s["id"]: s for s in HiddenStateShards(directory, "train")}
    assert both.keys() == one.keys()
    for key, sample in both.items():
        torch.testing.assert_close(sample["aux_hidden_states"], one[key]["aux_hidden_states"], rtol=1e-4, atol=1e-4)
    two_manifest = json.loads((directory / "manifest.json").read_text())
    assert two_manifest["splits"]["train"]["loss_tokens"] == manifest["splits"]["train"]["loss_tokens"]
