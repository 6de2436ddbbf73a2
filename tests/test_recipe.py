from pathlib import Path

import pytest

from speculators_train.data.mix import load_mix_config
from speculators_train.errors import UserError
from speculators_train.recipe import load_recipe, parse_overrides

from .conftest import REPO


@pytest.mark.parametrize("path", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_validates(path):
    recipe = load_recipe(path)
    assert recipe.resolve_path(recipe.data.mix, "data.mix").is_file()


@pytest.mark.parametrize("path", sorted((REPO / "data").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_mix_validates(path):
    mix = load_mix_config(path)
    for source in mix.sources:
        if source.path:
            assert mix.resolve_path(source.path, source.name).exists()


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(text)
    return path


def test_typo_names_file_key_and_suggestion(tmp_path):
    path = write(tmp_path, "name: x\ndata: {mix: m.yaml, max_lenght: 5}\n")
    with pytest.raises(UserError) as err:
        load_recipe(path)
    assert f"{path}: data.max_lenght: unknown key (did you mean max_length?)" in str(err.value)


def test_a_moved_key_names_its_new_place(tmp_path):
    path = write(tmp_path, "name: x\ndata: {mix: m.yaml}\neval: {cpu_packed_weights: false}\n")
    with pytest.raises(UserError, match=r"eval\.cpu_packed_weights: moved to target\.cpu_packed_weights"):
        load_recipe(path)


def test_unknown_section_lists_allowed(tmp_path):
    path = write(tmp_path, "name: x\ndata: {mix: m.yaml}\ntraning: {}\n")
    with pytest.raises(UserError, match=r"traning: unknown key \(did you mean training\?\)"):
        load_recipe(path)


def test_wrong_type_and_missing_key(tmp_path):
    path = write(tmp_path, "name: x\ndata: {max_length: lots}\ngeneration: {storage_dtype: int8}\n")
    with pytest.raises(UserError) as err:
        load_recipe(path)
    text = str(err.value)
    assert f"{path}: data.mix: required key is missing" in text
    assert f"{path}: data.max_length:" in text and "'lots'" in text
    assert f"{path}: generation.storage_dtype:" in text and "'int8'" in text


def test_invalid_yaml_reports_line(tmp_path):
    path = write(tmp_path, "name: x\ndata:\n  mix: [unclosed\n")
    with pytest.raises(UserError, match=rf"{path}:\d+:\d+: not valid YAML"):
        load_recipe(path)


def test_bad_device_and_layer_ids(tmp_path):
    path = write(tmp_path, "name: x\ndata: {mix: m}\ntarget: {device: gpu0, aux_layer_ids: [-1]}\n")
    with pytest.raises(UserError) as err:
        load_recipe(path)
    assert "target.device" in str(err.value) and "target.aux_layer_ids" in str(err.value)


def test_overrides_apply_and_validate(tmp_path):
    path = write(tmp_path, "name: x\ndata: {mix: m.yaml}\n")
    assert load_recipe(path, {"data.max_length": 64}).data.max_length == 64
    with pytest.raises(UserError, match=r"data\.max_len: unknown key"):
        load_recipe(path, {"data.max_len": 64})


def test_bare_no_means_no_mixed_precision_in_a_file_and_a_set(tmp_path):
    path = write(tmp_path, "name: x\ndata: {mix: m.yaml}\ntraining: {mixed_precision: no}\n")
    assert load_recipe(path).training.mixed_precision == "no"
    set_no = parse_overrides(["training.mixed_precision=no"])
    assert load_recipe(write(tmp_path, "name: x\ndata: {mix: m.yaml}\n"), set_no).training.mixed_precision == "no"
    with pytest.raises(UserError, match=r"training\.mixed_precision"):
        load_recipe(path, {"training.mixed_precision": True})


def test_missing_mix_file_names_key(tmp_path):
    recipe = load_recipe(write(tmp_path, "name: x\ndata: {mix: nowhere.yaml}\n"))
    with pytest.raises(UserError, match=r"data.mix: file 'nowhere.yaml' not found"):
        recipe.resolve_path(recipe.data.mix, "data.mix")


def test_invalid_training_and_eagle3_keys(tmp_path):
    path = write(
        tmp_path, "name: x\ndata: {mix: m.yaml}\ntraining: {learning_rate: -1, batch: 4}\neagle3: {ttt_steps: 0}\n"
    )
    with pytest.raises(UserError) as err:
        load_recipe(path)
    text = str(err.value)
    assert f"{path}: training.learning_rate: Input should be greater than 0 (got -1)" in text
    assert f"{path}: training.batch: unknown key (did you mean batch_size?)" in text
    assert f"{path}: eagle3.ttt_steps: Input should be greater than 0 (got 0)" in text


@pytest.mark.parametrize("stage", [0, 3, 5])
def test_deepspeed_stage_must_be_one_or_two(tmp_path, stage):
    path = write(tmp_path, f"name: x\ndata: {{mix: m.yaml}}\ntraining: {{deepspeed: {{zero_stage: {stage}}}}}\n")
    with pytest.raises(UserError, match=r"training\.deepspeed\.zero_stage"):
        load_recipe(path)


def test_max_length_must_leave_room_for_the_ttt_unroll(tmp_path):
    path = write(tmp_path, "name: x\ndata: {mix: m.yaml, max_length: 8}\neagle3: {ttt_steps: 7}\n")
    with pytest.raises(UserError, match=r"data\.max_length \(8\) must exceed eagle3\.ttt_steps \+ 1 \(8\)"):
        load_recipe(path)
