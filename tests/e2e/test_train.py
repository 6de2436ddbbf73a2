"""The EAGLE-3 trainer end to end on hidden states of the session target over real ShareGPT records."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from speculators_train.errors import UserError
from speculators_train.hidden_states.shards import HiddenStateShards
from speculators_train.recipe import load_recipe
from speculators_train.training.trainer import Trainer
from tests.children import CLI, Child, run_python
from tests.conftest import EAGLE3, REPO, SHAREGPT, SMOLLM2, TRAIN, losses, make_recipe, run_recipe, sweep


def test_tiny_draft_overfits_real_samples(tmp_path, states):
    """One TTT step: the assertion is on step 0, and 30 epochs reach 0.95 where 50 at TTT 2 reached 0.93."""
    recipe = load_recipe(
        run_recipe(tmp_path, states, training={"epochs": 30, "log_every_steps": 3}, draft={"ttt_steps": 1})
    )
    trainer = Trainer(recipe)
    trainer.train()
    records = [json.loads(x) for x in (tmp_path / "run" / "train" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in records if "train/full_acc_0" in r][-1]
    # Accuracy where the draft vocab can express the target's choice at all.
    reachable = last["train/full_acc_0"] / last["train/vocab_coverage"]
    assert reachable > 0.9, f"step-0 accuracy on the training samples only reached {reachable:.3f}"
    assert last["loss"] < 0.2 * records[0]["loss"]


def test_killed_run_resumes_with_the_same_loss_curve(tmp_path, states):
    settings = {"training": {"epochs": 4, "save_every_steps": 1}}
    clean = run_recipe(tmp_path / "clean", states, **settings)
    killed = run_recipe(tmp_path / "killed", states, **settings)
    run_python(CLI, ["train", clean], cwd=REPO).check_returncode()
    latest = tmp_path / "killed" / "run" / "train" / "checkpoints" / "latest.json"
    proc = Child(CLI, ["train", killed], cwd=REPO)
    deadline = time.time() + 300
    while time.time() < deadline and not (latest.is_file() and json.loads(latest.read_text())["step"] >= 3):
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    last_step = max(losses(tmp_path / "clean" / "run"))
    assert json.loads(latest.read_text())["step"] < last_step, "the run finished before it was killed"
    run_python(CLI, ["train", killed], cwd=REPO).check_returncode()
    assert_resumed_on_the_same_curve(tmp_path / "clean" / "run", tmp_path / "killed" / "run")


def assert_resumed_on_the_same_curve(clean: Path, resumed: Path) -> None:
    """A killed and resumed run logged the uninterrupted run's loss at every step and ends with its weights."""
    expected, got = losses(clean), losses(resumed)
    assert got.keys() == expected.keys()
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-6), f"step {step}"
    last = Path("train") / "checkpoints" / f"step-{max(expected):06d}" / "model.safetensors"
    a, b = load_file(clean / last), load_file(resumed / last)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6)


def two_ranks(recipe: Path) -> None:
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "speculators_train"]
    result = subprocess.run(
        [*torchrun, "train", str(recipe)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def single_rank_run(tmp_path_factory, states) -> Path:
    tmp = tmp_path_factory.mktemp("one")
    one = run_recipe(tmp, states, training={"epochs": 2, "batch_size": 4})
    run_python(CLI, ["train", one], cwd=REPO).check_returncode()
    return tmp / "run"


@pytest.fixture(scope="module")
def single_rank_losses(single_rank_run):
    return losses(single_rank_run)


def weights_mib(run: Path) -> float:
    """Rank 0's share of the objective's weights after its first step (`memory/weights_mib`)."""
    lines = (run / "train" / "metrics.jsonl").read_text().splitlines()
    return next(json.loads(x)["memory/weights_mib"] for x in lines if "memory/weights_mib" in x)


def test_two_cpu_ranks_match_one_rank_with_the_same_global_batch(tmp_path, states, single_rank_losses):
    two = run_recipe(tmp_path, states, training={"epochs": 2, "batch_size": 2})
    two_ranks(two)
    got = losses(tmp_path / "run")
    assert got.keys() == single_rank_losses.keys() and len(got) >= 4
    for step, expected in single_rank_losses.items():
        assert got[step] == pytest.approx(expected, rel=1e-4), f"step {step}"


# ZeRO-3 by default (it shards weights as well as optimizer state); ZeRO-2 with SPECULATORS_TRAIN_FULL=1.
@pytest.mark.parametrize("stage", sweep([2, 3], (3,)))
def test_deepspeed_zero_on_two_cpu_ranks_matches_ddp_and_resumes_exactly(
    tmp_path, states, single_rank_run, single_rank_losses, stage
):
    """ZeRO-2 and ZeRO-3 really engage on CPU (gloo), train like one rank with the same global batch, and a run
    stopped after a checkpoint continues on the same curve from the gathered (full, not rank-0-shard) optimizer
    state and, under ZeRO-3, weights."""
    settings = {"epochs": 2, "batch_size": 2, "save_every_steps": 1, "keep_last": 10}
    settings["deepspeed"] = {"zero_stage": stage}
    two_ranks(run_recipe(tmp_path, states, training=settings))
    run = tmp_path / "run" / "train"
    full = losses(tmp_path / "run")
    # ZeRO-3 engaged: each of the 2 ranks holds half of every weight; ZeRO-2 holds them whole.
    assert weights_mib(tmp_path / "run") == pytest.approx(
        weights_mib(single_rank_run) / (2 if stage == 3 else 1), rel=0.01
    )
    assert full.keys() == single_rank_losses.keys()
    for step, expected in single_rank_losses.items():
        assert full[step] == pytest.approx(expected, rel=1e-4), f"step {step}"
    saved = torch.load(run / "checkpoints" / "step-000003" / "optimizer.pt", weights_only=True)
    fc = load_file(run / "checkpoints" / "step-000003" / "model.safetensors")["fc.weight"]
    assert saved["zero"]["step"] == 3.0
    assert saved["zero"]["params"]["fc.weight"]["exp_avg"].shape == fc.shape
    torch.testing.assert_close(saved["zero"]["params"]["fc.weight"]["fp32"], fc, rtol=0, atol=0)

    # As if killed right after step 3's checkpoint: later checkpoints and log lines never happened.
    for later in run.glob("checkpoints/step-*"):
        if int(later.name[5:]) > 3:
            shutil.rmtree(later)
    for pointer in ("latest.json", "best.json"):
        (run / "checkpoints" / pointer).write_text(json.dumps({"step": 3, "metric": "none", "value": 0.0}))
    kept = [x for x in (run / "metrics.jsonl").read_text().splitlines() if json.loads(x)["step"] <= 3]
    (run / "metrics.jsonl").write_text("\n".join(kept) + "\n")
    two_ranks(tmp_path / "recipe.yaml")
    resumed = losses(tmp_path / "run")
    assert resumed.keys() == full.keys()
    for step in range(4, max(full) + 1):
        assert resumed[step] == pytest.approx(full[step], rel=1e-6), f"step {step}"


def held_out_metrics(run: Path) -> dict[str, float]:
    lines = [json.loads(x) for x in (run / "train" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in lines if any(k.startswith("val/") for k in r)][-1]
    return {k: v for k, v in last.items() if k.startswith("val/")}


def test_zero3_validates_ranks_with_uneven_held_out_batches_like_one_process(tmp_path, states):
    """Under ZeRO-3 a forward is a collective: with one sample a batch, rank 0 has two held-out batches and rank 1
    one, so rank 1 repeats its batch (or both would hang) and drops its metrics (or its sample would count twice)."""
    budget = {"max_steps": 2, "eval_every_steps": 2}
    one = run_recipe(tmp_path / "one", states, training={**budget, "batch_size": 2})
    run_python(CLI, ["train", one], cwd=REPO).check_returncode()
    three = {**budget, "batch_size": 1, "deepspeed": {"zero_stage": 3}}
    two_ranks(run_recipe(tmp_path / "zero3", states, training=three))
    assert len(HiddenStateShards(states, "held_out")) == 3  # 2 on rank 0, 1 on rank 1
    expected, got = held_out_metrics(tmp_path / "one" / "run"), held_out_metrics(tmp_path / "zero3" / "run")
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_best_checkpoint_survives_pruning_and_loads(tmp_path, states):
    from speculators_train.families.drafts import load_checkpoint
    from speculators_train.layout import read_pointer

    recipe = load_recipe(run_recipe(tmp_path, states, training={"epochs": 3, "keep_last": 1}))
    trainer = Trainer(recipe)
    metrics = trainer.train()
    root = tmp_path / "run" / "train" / "checkpoints"
    best = read_pointer(root / "best.json")
    assert best["metric"] == "predicted_al_3" and best["value"] >= 1.0
    assert (root / f"step-{best['step']:06d}").is_dir()
    assert len([p for p in root.glob("step-*")]) <= 2
    _, draft = load_checkpoint(root / f"step-{trainer.state['step']:06d}")
    assert draft.d2t.dtype == torch.int64 and draft.t2d.dtype == torch.bool
    assert draft.lm_head.weight.shape[0] == 1024 and 0 < metrics["full_acc_0"] <= 1


def test_states_from_another_target_or_layers_are_refused(tmp_path, states):
    recipe = load_recipe(run_recipe(tmp_path, states, target={"aux_layer_ids": [1, 2, 3]}))
    with pytest.raises(UserError, match=r"aux_layer_ids \[2, 4, 5\] there, \[1, 2, 3\] in the recipe"):
        Trainer(recipe)


def test_training_without_generated_states_says_what_to_run(tmp_path):
    recipe = load_recipe(make_recipe(tmp_path, [{"name": "sharegpt", "path": SHAREGPT, "max_records": 4}]))
    with pytest.raises(UserError, match=r"no manifest\.json; run `speculators-train generate <recipe>` first"):
        Trainer(recipe)


def test_online_training_writes_no_states_and_resumes_exactly(tmp_path, monkeypatch):
    """Online mode runs the real target in the loop; a crash after a checkpoint resumes to the same curve."""
    sections = {
        "generation": {"hidden_states": "online", "samples_per_shard": 8},
        "training": {**TRAIN, "epochs": 2, "save_every_steps": 1},
        "draft": EAGLE3,
    }
    sources = [{"name": "sharegpt", "path": SHAREGPT, "max_records": 20}]
    clean = load_recipe(make_recipe(tmp_path / "clean", sources, **sections))
    Trainer(clean).train()
    expected = losses(tmp_path / "clean" / "run")
    assert len(expected) >= 4 and not (tmp_path / "clean" / "run" / "hidden_states").exists()

    crashed = load_recipe(make_recipe(tmp_path / "crashed", sources, **sections))
    original_save = Trainer._save

    def save_then_crash(self):
        original_save(self)
        if self.state["step"] == 2:
            raise RuntimeError("simulated crash")

    monkeypatch.setattr(Trainer, "_save", save_then_crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        Trainer(crashed).train()
    monkeypatch.setattr(Trainer, "_save", original_save)
    resumed = Trainer(crashed)
    assert resumed.state["step"] == 2 and resumed.state["position"] is not None
    resumed.train()
    got = losses(tmp_path / "crashed" / "run")
    assert got.keys() == expected.keys()
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-6), f"step {step}"


def test_checkpoint_pointer_to_a_missing_step_falls_back_to_the_newest_complete(tmp_path):
    from transformers import LlamaConfig

    from speculators_train.families.eagle.model import Eagle3Config, Eagle3Draft
    from speculators_train.layout import latest_checkpoint
    from speculators_train.training.checkpoint import save_checkpoint

    config = Eagle3Config.for_target(
        LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, vocab_size=40),
        [1, 2, 3],
        8,
        False,
    )
    draft, root = Eagle3Draft(config), tmp_path / "checkpoints"
    for step in (1, 2):
        save_checkpoint(root, step, draft, None, {"step": step}, keep_last=5)
    save_checkpoint(root, 2, draft, None, {"step": 2, "again": True}, keep_last=5)  # a re-save replaces in place
    assert latest_checkpoint(root) == root / "step-000002"
    assert not list(root.glob(".step-*"))
    (root / "latest.json").write_text('{"step": 3}')  # killed between writing the pointer and the directory
    assert latest_checkpoint(root) == root / "step-000002"
    (root / "latest.json").write_text("{broken")
    with pytest.raises(UserError, match=r"latest\.json: checkpoint pointer is not valid JSON"):
        latest_checkpoint(root)


def test_empty_held_out_split_is_refused_before_training(tmp_path, states):
    import json as _json

    recipe = load_recipe(run_recipe(tmp_path, states))
    manifest_path = recipe.hidden_states_dir / "manifest.json"
    manifest = _json.loads(manifest_path.read_text())
    manifest["splits"]["held_out"]["shards"] = []
    manifest_path.write_text(_json.dumps(manifest))
    with pytest.raises(UserError, match="held-out split has no samples"):
        Trainer(recipe)


def test_a_draft_exported_for_sglang_fine_tunes_from_its_own_weights_and_vocab(tmp_path, states, target):
    from speculators_train.export.run import export
    from speculators_train.families.drafts import draft_state_dict, load_checkpoint, resolve_checkpoint

    first = load_recipe(run_recipe(tmp_path / "a", states))
    Trainer(first).train()
    exported = export(first, None, "sglang", tmp_path / "sglang", "float32").path
    original = draft_state_dict(load_checkpoint(resolve_checkpoint(tmp_path / "a" / "run"))[1])

    training = {"init_from": str(exported), "learning_rate": 1e-4}
    second = load_recipe(run_recipe(tmp_path / "b", states, training=training, draft={"draft_vocab_size": 512}))
    trainer = Trainer(second)
    start = draft_state_dict(trainer.draft)
    assert start.keys() == original.keys()
    for name, tensor in original.items():  # the imported weights and vocab, not a fresh 512-id draft
        assert torch.equal(start[name], tensor), name
    trainer.train()
    _, tuned = load_checkpoint(resolve_checkpoint(tmp_path / "b" / "run"))
    assert tuned.config.draft_vocab_size == 1024 and torch.equal(tuned.d2t, original["d2t"])
    assert not torch.equal(tuned.fc.weight, original["fc.weight"])

    from speculators_train.families.eagle.model import Eagle3Config, Eagle3Draft
    from speculators_train.training.checkpoint import save_checkpoint

    other = Eagle3Draft(Eagle3Config.for_target(target.config, [3, 4, 5], 64, False))
    elsewhere = save_checkpoint(tmp_path / "other", 1, other, None, {}, 1)
    recipe = load_recipe(run_recipe(tmp_path / "c", states, training={"init_from": str(elsewhere)}))
    with pytest.raises(UserError, match=r"reads target layers \[3, 4, 5\], but the hidden states hold \[2, 4, 5\]"):
        Trainer(recipe)


def test_medusa_heads_learn_tokens_two_ahead_on_real_states_and_verify_with_their_measured_tree(
    tmp_path, smollm2_states
):
    """On SmolLM2: a trained model's text is what separates token t+2 from t+1. A random target's replies repeat
    tokens, so heads that still name t+1 (their start, the target's lm_head) already score there, and a few steps on
    sixteen records have nothing to learn from."""
    from speculators_train.families.drafts import load_checkpoint, resolve_checkpoint
    from speculators_train.families.medusa.model import MedusaDraft

    medusa = {"family": "medusa", "num_heads": 3, "draft_vocab_size": 1024}
    recipe = load_recipe(run_recipe(tmp_path, smollm2_states, training={"epochs": 8}, draft=medusa, target=SMOLLM2))
    trainer = Trainer(recipe)
    before = trainer.validate()
    after = trainer.train()
    # At the start every head is the target's own lm_head, which names token t+1, not t+2+h. Sixteen training
    # records move the held-out cross-entropy by about 4 nats but top-1 by only a few of ~230 tokens.
    assert after["loss_0"] < before["loss_0"] - 2 and after["loss_2"] < before["loss_2"] - 2
    assert after["top1_acc_0"] > before["top1_acc_0"]
    assert after["top5_acc_0"] >= after["top1_acc_0"] and 0 <= after["full_acc_2"] <= after["full_acc_0"]
    assert after["predicted_al_3"] == pytest.approx(1 + sum(after[f"full_acc_{h}"] for h in range(3)))
    path = resolve_checkpoint(tmp_path / "run")
    names = set(load_file(path / "model.safetensors"))
    assert {"blocks.2.layers.0.weight", "blocks.2.layers.0.bias", "lm_heads.2.weight", "d2t", "t2d"} == names - {
        f"{kind}.{h}.{rest}"
        for kind, rest in (("blocks", "layers.0.weight"), ("blocks", "layers.0.bias"), ("lm_heads", "weight"))
        for h in (0, 1)
    }
    _, heads = load_checkpoint(path)
    assert isinstance(heads, MedusaDraft) and heads.config.num_heads == 3
    held_out = json.loads((path / "trainer_state.json").read_text())["held_out"]
    assert held_out["rank0_acc_0"] == pytest.approx(after["top1_acc_0"])

    # The measured tree is built from those accuracies, and decoding with it is the target's own greedy output.
    from speculators_train.verify.run import verify

    recipe.eval.mode, recipe.eval.tree.shape, recipe.eval.num_prompts, recipe.eval.max_new_tokens = (
        "tree",
        "measured",
        2,
        12,
    )
    recipe.eval.tree.budget = 6
    _, records = verify(recipe, tmp_path / "run", tmp_path / "verify")
    assert re.fullmatch(r"tree\(measured, depth=[1-3], budget=6\)", records[0]["shape"])
    assert records[0]["greedy_identical_outputs"] == "2/2"


def test_a_time_budget_stops_training_and_schedules_the_learning_rate_over_the_time(tmp_path, states):
    """training.max_minutes: the run stops at the first step past the budget, validation time is not counted, and
    the cosine schedule runs over the time (so the learning rate falls as the budget is spent, to 0 at its end)."""
    budget = 0.1  # 6 s of training steps; 50 epochs would take far longer
    recipe = load_recipe(
        run_recipe(tmp_path, states, training={"epochs": 50, "max_minutes": budget, "eval_every_steps": 2})
    )
    trainer = Trainer(recipe)
    trainer.train()
    state = trainer.state
    assert 60 * budget <= state["train_seconds"] < 60 * budget + 30  # one step past the budget at most
    assert state["epoch"] < 50 and state["step"] == state["held_out_step"]
    records = [json.loads(x) for x in (tmp_path / "run" / "train" / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in records if "lr" in r]
    assert len(lrs) == state["step"] >= 2
    assert lrs == sorted(lrs, reverse=True) and lrs[-1] == 0.0 < lrs[0]  # warmup_ratio 0 here: cosine from the start
    assert trainer.train() == state["held_out"] and trainer.state["step"] == state["step"]  # a rerun does nothing


def test_a_run_saved_before_a_setting_existed_resumes(tmp_path, states):
    """Checkpoints record the draft and data settings a resumed run must share; an option added to either since
    (EAGLE-3.1's norms, the loss, the regeneration engine) reads as its default, not as a different run."""
    path = run_recipe(tmp_path, states, training={"epochs": 2})
    trainer = Trainer(load_recipe(path, {"training.max_steps": 2}))
    trainer.train()
    ckpt_dir = tmp_path / "run" / "train" / "checkpoints"
    state_file = (
        ckpt_dir / f"step-{json.loads((ckpt_dir / 'latest.json').read_text())['step']:06d}" / "trainer_state.json"
    )
    state = json.loads(state_file.read_text())
    for key in ("norm_before_fc", "norm_output", "loss"):
        del state["identity"]["draft"][key]
    del state["identity"]["data"]["regenerate"]["engine"]
    state_file.write_text(json.dumps(state))
    resumed = Trainer(load_recipe(path))
    assert resumed.state["step"] == 2
    with pytest.raises(UserError, match=r"trained with other settings .*draft"):
        Trainer(load_recipe(path, {"draft.loss": "lk"}))


def test_acceptance_guided_selection_trains_on_the_samples_the_draft_fails_on(tmp_path, states):
    """training.select scores every stored sample with the draft being fine-tuned (teacher-forced acceptance
    length) and trains on the lowest `keep` share; `uniform` keeps a seeded subset of the same size."""
    from speculators_train.training.select import acceptance_lengths

    first = run_recipe(tmp_path / "first", states, training={"epochs": 1})
    Trainer(load_recipe(first)).train()
    start = tmp_path / "first" / "run" / "train" / "checkpoints"
    chosen = {}
    for by in ("acceptance", "uniform"):
        path = run_recipe(tmp_path / by, states, training={"init_from": str(start), "max_steps": 1})
        trainer = Trainer(load_recipe(path, {"training.select": {"keep": 0.5, "by": by}}))
        source = trainer.batches
        n = len(source.train)
        assert len(source.kept) == round(n / 2)
        seen = {i for e in range(2) for batch in source._batches(e) for i in batch}
        assert seen <= set(source.kept)
        chosen[by] = source.kept
    scorer = Trainer(load_recipe(run_recipe(tmp_path / "scorer", states, training={"init_from": str(start)})))
    scores = acceptance_lengths(scorer.objective, scorer.batches.train, torch.device("cpu"))
    assert max(scores[i] for i in chosen["acceptance"]) <= min(
        scores[i] for i in range(len(scores)) if i not in chosen["acceptance"]
    )
    assert chosen["uniform"] != chosen["acceptance"]
    with pytest.raises(UserError, match=r"training\.select scores stored samples .* needs training\.init_from"):
        load_recipe(first, {"training.select": {"keep": 0.5}})
