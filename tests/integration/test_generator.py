"""The hidden-state generator end to end on the real target and real ShareGPT records."""

import dataclasses
import errno
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from speculators_train.data.config import RegenerateConfig
from speculators_train.data.splits import load_splits
from speculators_train.errors import UserError
from speculators_train.files import atomic_write_bytes
from speculators_train.hidden_states.generator import generate
from speculators_train.hidden_states.pipeline import process_chunk
from speculators_train.hidden_states.shards import TENSORS, HiddenStateShards, read_manifest, validate
from speculators_train.packed import available
from speculators_train.recipe import load_recipe
from speculators_train.training.batches import StoredBatches
from tests.children import CLI, run_python
from tests.conftest import REPO, SHAREGPT, make_recipe
from tests.faults import clean_error
from tests.unit.test_data_inputs import empty_replies


def shard_tensors(directory: Path) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for path in sorted(directory.glob("*/shard-*.safetensors")):
        with safe_open(path, framework="pt") as fh:
            out[f"{path.parent.name}/{path.name}"] = {k: fh.get_tensor(k) for k in TENSORS} | {
                "ids": fh.metadata()["sample_ids"]
            }
    return out


def assert_same_shards(a: Path, b: Path) -> None:
    ta, tb = shard_tensors(a), shard_tensors(b)
    assert ta.keys() == tb.keys() and ta
    for name in ta:
        assert ta[name]["ids"] == tb[name]["ids"], name
        for key in TENSORS:
            torch.testing.assert_close(ta[name][key], tb[name][key], rtol=0, atol=0, msg=f"{name}:{key}")


@pytest.fixture(scope="module")
def generated(states):
    """The session's stored states, a real `generate` run over 20 records, with its recipe and manifest (read only:
    tests that damage or extend them work on copies)."""
    return load_recipe(states.parent.parent / "recipe.yaml"), read_manifest(states)


def test_stored_states_equal_an_independent_transformers_forward(generated, target):
    recipe, manifest = generated
    h, ids_ = target.hidden_size, manifest["identity"]["aux_layer_ids"]
    assert ids_ == [2, 4, 5] and manifest["identity"]["final_state"] == "pre_norm"
    samples = HiddenStateShards(recipe.hidden_states_dir, "train")
    assert len(samples) == manifest["splits"]["train"]["samples"] > 10
    for sample in samples:
        with torch.no_grad():
            ref = target.model(sample["input_ids"][None], output_hidden_states=True)
        # Batched (padded) vs single-sample fp32 forward: equal up to float noise relative to the
        # residual stream's scale; a wrong layer would be off by the scale itself.
        for j, k in enumerate(ids_):
            expected = ref.hidden_states[k][0]
            stored = sample["aux_hidden_states"][:, j * h : (j + 1) * h]
            torch.testing.assert_close(stored, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))
        final = target.final_norm(sample["hidden_state"])
        torch.testing.assert_close(final, ref.hidden_states[-1][0], rtol=1e-4, atol=1e-4 * float(final.abs().max()))


@pytest.mark.skipif(not available(nn.Linear(2, 2)), reason="needs a CPU torch built with oneDNN")
def test_chunks_capture_on_packed_weights_and_match_the_default_kernels(generated, target, monkeypatch):
    """Packing (`target.cpu_packed_weights`, on by default) changes only float32 rounding, and is undone after
    the chunk; off, the default kernels run."""
    recipe, _ = generated
    chunk = load_splits(recipe).train[:4]
    calls = []
    linear = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(1) or linear(*a))
    plain = process_chunk(recipe, dataclasses.replace(target, cpu_packed_weights=False), chunk, 0).samples
    assert not calls
    packed = process_chunk(recipe, target, chunk, 0).samples
    assert calls and "forward" not in target.lm_head.__dict__
    assert [s["id"] for s in packed] == [s["id"] for s in plain] and plain
    for got, want in zip(packed, plain, strict=True):
        for key in ("aux_hidden_states", "hidden_state"):
            scale = float(want[key].abs().max())
            torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-4 * scale, msg=key)


def test_manifest_counts_token_freq_and_validate(generated):
    recipe, manifest = generated
    directory = recipe.hidden_states_dir
    assert validate(directory) == []
    assert manifest["splits"]["train"]["records"] + manifest["splits"]["held_out"]["records"] == 20
    assert manifest["splits"]["held_out"]["samples"] > 0
    with safe_open(directory / "token_freq.safetensors", framework="pt") as fh:
        freq = fh.get_tensor("token_freq")
    assert freq.dtype == torch.int64 and freq.shape == (49152,)
    assert int(freq.sum()) == manifest["splits"]["train"]["loss_tokens"]
    expected = torch.zeros_like(freq)
    for sample in HiddenStateShards(directory, "train"):
        expected += torch.bincount(sample["input_ids"][sample["loss_mask"]], minlength=len(freq))
    assert torch.equal(freq, expected), "frequencies count train loss-masked tokens only"
    assert all(len(s["sha256"]) == 64 for s in manifest["splits"]["train"]["shards"] if s["num_samples"])


def test_online_mode_yields_the_same_samples(generated, target):
    """Online training's source cuts the held-out split into the generator's chunks, with the same seeds: it holds
    exactly the samples `generate` stored."""
    from speculators_train.training.batches import CapturedBatches

    recipe, _ = generated
    stored = {s["id"]: s for s in HiddenStateShards(recipe.hidden_states_dir, "held_out")}
    online = CapturedBatches(recipe, target, 1, 0, lambda value: value).held_out
    assert [s["id"] for s in online] == list(stored)
    for sample in online:
        for key in TENSORS[:-1]:
            torch.testing.assert_close(sample[key], stored[sample["id"]][key], rtol=0, atol=0)


def test_validate_detects_corruption_and_unlisted_files(generated, tmp_path):
    import shutil

    recipe, _ = generated
    copy = tmp_path / "hs"
    shutil.copytree(recipe.hidden_states_dir, copy)
    shard = next((copy / "train").glob("shard-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    (copy / "train" / "shard-r000-999999.safetensors").write_bytes(b"x")
    problems = validate(copy)
    assert any("checksum mismatch" in p and shard.name in p for p in problems)
    assert any("not listed in the manifest" in p for p in problems)


def test_rerun_of_complete_output_is_a_no_op_and_other_settings_refuse_to_mix(generated):
    recipe, manifest = generated
    before = {p: p.stat().st_mtime_ns for p in recipe.hidden_states_dir.rglob("*") if p.is_file()}
    assert generate(recipe) == manifest
    assert before == {p: p.stat().st_mtime_ns for p in recipe.hidden_states_dir.rglob("*") if p.is_file()}
    other = recipe.model_copy(update={"target": recipe.target.model_copy(update={"aux_layer_ids": [1, 2, 3]})})
    other._source_path = recipe.source_path
    with pytest.raises(UserError, match=r"refusing to mix them:\n  aux_layer_ids: \[2, 4, 5\] there, \[1, 2, 3\] now"):
        generate(other)


def test_output_written_before_a_regenerate_option_existed_still_trains_and_reruns(generated, tmp_path):
    """Adding a setting (here `regenerate.max_turns`) must not make every earlier output "another setup";
    a real change of what the text is made of still must."""
    recipe, _ = generated
    copy = tmp_path / "run" / "hidden_states"
    shutil.copytree(recipe.hidden_states_dir, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["identity"]["regenerate"] = {"enabled": False, "temperature": 0.0, "top_p": 1.0, "max_new_tokens": 256}
    atomic_write_bytes(copy / "manifest.json", json.dumps(manifest).encode())
    moved = recipe.model_copy(update={"output_dir": str(tmp_path / "run")})
    moved._source_path = recipe.source_path
    assert generate(moved)["identity"]["regenerate"]["enabled"] is False
    assert StoredBatches(moved, world=1, rank=0).train is not None
    regenerated = moved.model_copy(
        update={"data": moved.data.model_copy(update={"regenerate": RegenerateConfig(enabled=True)})}
    )
    regenerated._source_path = recipe.source_path
    with pytest.raises(UserError, match=r"another setup: data\.regenerate \{'enabled': False\} there"):
        StoredBatches(regenerated, world=1, rank=0)


def test_a_medusa_or_mlp_recipe_stores_the_final_state_alone_and_a_family_takes_a_set_that_holds_what_it_reads(
    generated, tmp_path
):
    """`generate` stores what the recipe's family trains on: Medusa heads and MLP stages read the final state, so no
    aux states; EAGLE-3's set (aux + final) serves a Medusa recipe as it is, and Medusa's set is refused to EAGLE-3
    in one line."""
    eagle3, manifest = generated
    assert manifest["identity"]["target_states"] == "aux+final"
    sources = [{"name": "sharegpt", "path": SHAREGPT, "max_records": 20}]
    medusa = load_recipe(make_recipe(tmp_path / "m", sources, draft={"family": "medusa"}))
    made = generate(medusa)
    directory = medusa.hidden_states_dir
    assert made["identity"]["target_states"] == "final" and validate(directory) == []
    for path in directory.glob("*/shard-*.safetensors"):
        with safe_open(path, framework="pt") as fh:
            assert sorted(fh.keys()) == ["hidden_state", "input_ids", "loss_mask", "offsets"], path
    full = {s["id"]: s for s in HiddenStateShards(eagle3.hidden_states_dir, "train")}
    alone = list(HiddenStateShards(directory, "train"))
    assert [s["id"] for s in alone] == list(full) and "aux_hidden_states" not in alone[0]
    for sample in alone:  # the same capture, less of it
        torch.testing.assert_close(sample["hidden_state"], full[sample["id"]]["hidden_state"], rtol=0, atol=0)
    assert sum(f.stat().st_size for f in directory.rglob("shard-*")) * 3 < sum(
        f.stat().st_size for f in eagle3.hidden_states_dir.rglob("shard-*")
    )
    # An MLP speculator reads the same state, so its recipe stores the same files.
    mlp = load_recipe(make_recipe(tmp_path / "p", sources, draft={"family": "mlp"}))
    assert generate(mlp)["identity"]["target_states"] == "final" and validate(mlp.hidden_states_dir) == []
    shards = sorted(p.relative_to(directory) for p in directory.glob("*/shard-*.safetensors"))
    assert shards == sorted(p.relative_to(mlp.hidden_states_dir) for p in mlp.hidden_states_dir.glob("*/shard-*"))
    for name in shards:
        with safe_open(directory / name, framework="pt") as a, safe_open(mlp.hidden_states_dir / name, "pt") as b:
            keys = a.keys()
            assert keys == b.keys()
            for key in keys:
                torch.testing.assert_close(a.get_tensor(key), b.get_tensor(key), rtol=0, atol=0, msg=f"{name}:{key}")

    with pytest.raises(UserError, match=r"holds 'final' target states and a eagle3 draft trains on 'aux\+final'"):
        StoredBatches(medusa.model_copy(update={"draft": eagle3.draft}), world=1, rank=0)
    with pytest.raises(UserError, match=r"refusing to mix them:\n  target_states: 'final' there, 'aux\+final' now"):
        generate(medusa.model_copy(update={"draft": eagle3.draft}))
    # The other way round: Medusa trains on EAGLE-3's set, and generating for it there has nothing to do.
    on_full = eagle3.model_copy(update={"draft": medusa.draft})
    before = {p: p.stat().st_mtime_ns for p in eagle3.hidden_states_dir.rglob("*") if p.is_file()}
    assert generate(on_full) == manifest
    assert before == {p: p.stat().st_mtime_ns for p in eagle3.hidden_states_dir.rglob("*") if p.is_file()}
    read = StoredBatches(on_full, world=1, rank=0).train
    assert len(read) == len(full) and "aux_hidden_states" not in read[0]  # read only what Medusa trains on

    # A shard whose tensors are not the states its manifest names is a problem `validate` names.
    listed = json.loads((directory / "manifest.json").read_text())
    listed["identity"]["target_states"] = "aux+final"
    atomic_write_bytes(directory / "manifest.json", json.dumps(listed).encode())
    shards = [p for p in validate(directory) if "/shard-" in p]
    assert len(shards) == len(list(directory.glob("*/shard-*"))), shards
    assert all(
        "holds ['hidden_state', 'input_ids', 'loss_mask', 'offsets'], the manifest's states are 'aux+final'" in p
        for p in shards
    )


def test_a_family_that_reads_no_target_state_gets_tokens_and_masks_alone(generated, target, monkeypatch):
    """`target_states: none` (a draft distilled from tokens only): the chunk keeps ids and masks, no state."""
    from speculators_train.families import get

    recipe, _ = generated
    monkeypatch.setattr(get("medusa").settings, "target_states", "none")
    medusa = recipe.model_copy(update={"draft": get("medusa").settings()})
    chunk = load_splits(recipe).train[:4]
    alone = process_chunk(medusa, target, chunk, 0).samples
    full = process_chunk(recipe, target, chunk, 0).samples
    assert alone and [sorted(s) for s in alone] == [["id", "input_ids", "loss_mask", "record"]] * len(full)
    assert [s["input_ids"].tolist() for s in alone] == [s["input_ids"].tolist() for s in full]


def test_crash_between_shard_write_and_progress_update_is_redone(sharegpt_recipe, target):
    recipe = load_recipe(sharegpt_recipe)
    generate(recipe)
    directory = recipe.hidden_states_dir
    reference = shard_tensors(directory)
    # Simulate a crash after shard 2 landed but before it was recorded, with a half-written temp file.
    progress = directory / "progress" / "rank000.json"
    state = json.loads(progress.read_text())
    state["shards"]["train"] = state["shards"]["train"][:2]
    state["shards"]["held_out"] = []
    progress.write_text(json.dumps(state))
    (directory / "manifest.json").unlink()
    (directory / "train" / ".shard-r000-000003.safetensors.tmp-123").write_bytes(b"half")
    generate(recipe)
    assert validate(directory) == []
    assert not list(directory.rglob("*.tmp-*"))
    assert shard_tensors(directory).keys() == reference.keys()


def test_generate_refuses_online_mode(sharegpt_recipe):
    recipe = load_recipe(sharegpt_recipe, {"generation.hidden_states": "online"})
    with pytest.raises(UserError, match=r"generation\.hidden_states is 'online'"):
        generate(recipe)


def test_full_disk_gives_a_clear_error_and_leaves_no_partial_file(tmp_path, monkeypatch):
    def no_space(_fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("speculators_train.files.os.fsync", no_space)
    target_file = tmp_path / "shard.safetensors"
    with pytest.raises(
        UserError, match=r"disk full while writing .*shard.safetensors.*rerun the same command to resume"
    ):
        atomic_write_bytes(target_file, b"x" * 100)
    assert list(tmp_path.iterdir()) == []


def test_cli_reports_bad_recipe_without_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ndata: {mix: m.yaml}\ngeneration: {samples_per_shrad: 3}\n")
    result = run_python(CLI, ["generate", bad], cwd=REPO)
    assert result.returncode == 2
    assert "generation.samples_per_shrad: unknown key (did you mean samples_per_shard?)" in result.stderr
    assert "Traceback" not in result.stderr


def test_damaged_manifest_and_progress_files_name_themselves(tmp_path):
    from speculators_train.hidden_states.generator import Progress
    from speculators_train.hidden_states.shards import read_manifest

    (tmp_path / "manifest.json").write_text('{"format": "speculators_train.hidden_')
    with pytest.raises(UserError, match=r"manifest\.json: hidden-state manifest is not valid JSON"):
        read_manifest(tmp_path)
    progress = tmp_path / "progress" / "rank000.json"
    progress.parent.mkdir()
    progress.write_text("")
    with pytest.raises(UserError, match=r"rank000\.json: generation progress is not valid JSON"):
        Progress(progress, {})


def test_a_split_left_without_samples_is_refused_by_generate_with_the_reasons(tmp_path, capsys):
    """`data`'s refusal of records that render to nothing, from `generate`, which loads the target first (before it,
    `generate` exited 0 with no samples and `train` asked for a larger held-out fraction)."""
    recipe = empty_replies(tmp_path)
    clean_error(["generate", recipe], capsys, "split's", "records gave no sample", "no_reply_after_a_prompt")
    assert not (tmp_path / "run" / "hidden_states" / "manifest.json").exists()
