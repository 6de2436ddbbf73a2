"""`doctor` on a real EAGLE-3 draft fitted to the session target, exported in the speculators format: a clean
export passes, and each seeded defect is named with the field, what training used and what the engine will use."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from speculators_train.doctor.report import Check
from speculators_train.doctor.run import doctor
from speculators_train.export.run import export
from speculators_train.recipe import load_recipe
from tests.conftest import SHAREGPT, make_recipe


@pytest.fixture(scope="module")
def case(fitted, states, tmp_path_factory):
    """(recipe, checkpoint, a clean export): the draft trained with `norm_output` on, so that a dropped flag shows;
    the recipe's hidden states are the session's (their manifest)."""
    _, checkpoint, _, _ = fitted("eagle3", norm_output=True)
    tmp = tmp_path_factory.mktemp("doctor")
    path = make_recipe(
        tmp,
        [{"name": "s", "path": SHAREGPT}],
        draft={"family": "eagle3", "norm_output": True},
        export={"dtype": "float32"},
        eval={"suites": ["eval/suites/sharegpt-held-out.yaml"], "num_prompts": 2, "max_new_tokens": 16},
    )
    recipe = load_recipe(path)
    recipe.hidden_states_dir.mkdir(parents=True)
    shutil.copy(states / "manifest.json", recipe.hidden_states_dir / "manifest.json")
    clean = export(recipe, checkpoint, "speculators", tmp / "clean", "float32").path
    return recipe, checkpoint, clean


def run(case, tmp_path, edit=None) -> dict[str, Check]:
    recipe, checkpoint, clean = case
    export_dir = tmp_path / "export"
    shutil.copytree(clean, export_dir)
    if edit:
        edit(export_dir)
    _, checks = doctor(recipe, export_dir, checkpoint, "vllm", tmp_path / "report")
    assert (tmp_path / "report" / "doctor.md").is_file() and (tmp_path / "report" / "doctor.json").is_file()
    return {c.name: c for c in checks}


def edit_config(change):
    def edit(folder):
        config = json.loads((folder / "config.json").read_text())
        change(config)
        (folder / "config.json").write_text(json.dumps(config))

    return edit


def test_a_clean_export_passes_every_check(case, tmp_path):
    checks = run(case, tmp_path)
    assert [c.name for c in checks.values() if c.status == "fail"] == []
    assert checks["vLLM reads the export as trained"].status == "pass"
    assert checks["chat template: training against serving"].status == "pass"


def test_aux_layer_ids_off_by_one_are_named_with_what_vllm_will_capture(case, tmp_path):
    def shift(config):
        config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in config["eagle_aux_hidden_state_layer_ids"]]

    checks = run(case, tmp_path, edit_config(shift))
    served = checks["vLLM reads the export as trained"]
    assert served.status == "fail"
    trained = json.loads((case[2] / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    assert f"eagle_aux_hidden_state_layer_ids: trained {trained!r}, vLLM will use {[i + 1 for i in trained]!r}" in (
        served.detail
    )
    assert checks["speculators config.json as trained"].status == "fail"


def test_a_norm_flag_dropped_from_the_config_is_named_with_vllms_default(case, tmp_path):
    checks = run(case, tmp_path, edit_config(lambda config: config.pop("norm_output")))
    served = checks["vLLM reads the export as trained"]
    assert served.status == "fail" and "norm_output: trained True, vLLM will use False" in served.detail
    assert (
        "norm_output: trained True, the export has '<missing>'" in checks["speculators config.json as trained"].detail
    )


def test_a_vocabulary_map_from_other_token_counts_is_named(case, tmp_path):
    def other_d2t(folder):
        weights = load_file(folder / "model.safetensors")
        weights["d2t"] = torch.roll(weights["d2t"], 1)
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})

    check = run(case, tmp_path, other_d2t)["speculators tensors as trained"]
    assert check.status == "fail" and check.detail.startswith("d2t: ") and "token counts" in check.fix


def test_a_chat_template_changed_after_training_fails_with_the_fix(case, tmp_path):
    recipe = case[0]
    manifest = recipe.hidden_states_dir / "manifest.json"
    kept = manifest.read_text()
    data = json.loads(kept)
    data["identity"]["chat_template_hash"] = "0123456789abcdef"
    manifest.write_text(json.dumps(data))
    try:
        check = run(case, tmp_path)["chat template: training against serving"]
    finally:
        manifest.write_text(kept)
    assert check.status == "fail" and "0123456789abcdef there" in check.detail and "regenerate" in check.fix


def test_states_in_another_dtype_than_the_served_draft_warn(case, tmp_path):
    check = run(case, tmp_path, edit_config(lambda config: config.update(dtype="bfloat16")))
    dtype = check["state dtype: training against serving"]
    assert dtype.status == "warn" and "in float32, the draft served in bfloat16" in dtype.detail


def test_the_command_prints_every_check_and_exits_1_on_a_failure(case, tmp_path, capsys):
    from speculators_train.cli import main

    recipe, checkpoint, clean = case
    shutil.copytree(clean, tmp_path / "export")
    edit_config(lambda config: config.pop("norm_output"))(tmp_path / "export")
    argv = ["doctor", str(recipe.source_path), "--draft", str(tmp_path / "export"), "--checkpoint", str(checkpoint)]
    with pytest.raises(SystemExit) as code:
        main([*argv, "--out", str(tmp_path / "report")])
    assert code.value.code == 1
    out = capsys.readouterr().out
    assert "vLLM will use False" in out and "export again" in out
    report = json.loads((tmp_path / "report" / "doctor.json").read_text())
    assert {c["status"] for c in report} >= {"fail", "pass"}


def test_a_vocabulary_without_the_targets_tokens_is_a_ceiling_named_with_its_share(case, target, tmp_path):
    """A draft whose vocabulary was built from other data (here: the top 512 ids, which the target's replies do
    not use) can accept nothing where the next token is outside it."""
    from speculators_train.families import get
    from speculators_train.head import load_head_weights
    from speculators_train.recipe import TargetConfig
    from speculators_train.training.checkpoint import save_checkpoint
    from tests.conftest import start_of

    recipe = case[0]
    family = get("eagle3")
    freq = torch.zeros(target.vocab_size, dtype=torch.int64)
    freq[-512:] = 1
    config, weights = load_head_weights(TargetConfig())
    settings = family.settings(family="eagle3", norm_output=True, **family.settings.small.settings)
    draft = family.new_draft(settings, start_of(config, weights, freq, target.aux_layer_ids))
    checkpoint = save_checkpoint(tmp_path / "ckpt", 1, draft, None, {"step": 1}, keep_last=1)
    out = export(recipe, checkpoint, "speculators", tmp_path / "out", "float32").path
    _, checks = doctor(recipe, out, checkpoint, "vllm", tmp_path / "report")
    check = {c.name: c for c in checks}["draft vocabulary covers the target's tokens"]
    assert check.status == "warn" and "(100.0%) are outside" in check.detail, check.detail
