import re
from pathlib import Path

import pytest

from speculators_train.data.mix import load_mix_config
from speculators_train.errors import UserError
from speculators_train.families import FAMILIES
from speculators_train.recipe import load_recipe
from speculators_train.schema import parse_overrides
from tests.conftest import REPO


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


@pytest.mark.parametrize(
    ("ids", "reason"),
    [
        ("[27, 15, 2]", r"not ascending: engines capture aux states in layer order, .* write \[2, 15, 27\]"),
        ("[2, 15, 15, 27]", r"repeats \[15\]: engines capture each layer once"),
        ("[0, 15, 27]", r"ids must be >= 1: id 0 is the embeddings"),
        ("[]", r"must be a non-empty list"),
    ],
    ids=["descending", "duplicate", "embeddings", "empty"],
)
def test_aux_layer_ids_no_engine_runs_as_trained_are_refused_with_the_reason(tmp_path, ids, reason):
    path = write(tmp_path, f"name: x\ndata: {{mix: m.yaml}}\ntarget: {{aux_layer_ids: {ids}}}\n")
    with pytest.raises(UserError) as err:
        load_recipe(path)
    lines = str(err.value).splitlines()
    assert len(lines) == 2 and lines[1].startswith(f"  {path}: target.aux_layer_ids: ")
    assert re.search(reason, lines[1]), lines[1]


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


def test_invalid_training_and_draft_keys(tmp_path):
    path = write(
        tmp_path,
        "name: x\ndata: {mix: m.yaml}\ntraining: {learning_rate: -1, batch: 4}\n"
        "draft: {family: eagle3, ttt_steps: 0, step_decy: 0.5}\n",
    )
    with pytest.raises(UserError) as err:
        load_recipe(path)
    text = str(err.value)
    assert f"{path}: training.learning_rate: Input should be greater than 0 (got -1)" in text
    assert f"{path}: training.batch: unknown key (did you mean batch_size?)" in text
    # The family's own section: its keys are named as written (the family tag is not part of the key).
    assert f"{path}: draft.ttt_steps: Input should be greater than 0 (got 0)" in text
    assert f"{path}: draft.step_decy: unknown key (did you mean step_decay?)" in text


def test_the_draft_section_names_a_registered_family(tmp_path):
    registered = re.escape(f"(one of {', '.join(map(repr, FAMILIES))})")
    for text, message in (
        ("draft: {ttt_steps: 3}", r"draft\.family: is missing " + registered),
        ("draft: {family: eagle4}", r"draft\.family: 'eagle4' is not registered " + registered),
        ("draft: {family: medusa, ttt_steps: 3}", r"draft\.ttt_steps: unknown key \(allowed: draft_vocab_size"),
    ):
        with pytest.raises(UserError, match=message):
            load_recipe(write(tmp_path, f"name: x\ndata: {{mix: m.yaml}}\n{text}\n"))
    assert load_recipe(write(tmp_path, "name: x\ndata: {mix: m.yaml}\n")).draft.family == "eagle3"  # the default


def test_a_recipe_in_the_old_layout_is_told_the_new_spelling_with_its_own_values(tmp_path):
    old = "name: x\ndata: {mix: m.yaml}\ntraining: {algorithm: medusa, epochs: 2}\nmedusa: {num_heads: 3}\n"
    with pytest.raises(UserError) as err:
        load_recipe(write(tmp_path, old))
    assert str(err.value) == (
        f"{tmp_path / 'r.yaml'}: training.algorithm, medusa: is the old layout; the draft family and its settings "
        "now read {draft: {family: medusa, num_heads: 3}}"
    )
    with pytest.raises(UserError, match=r"eagle3: is the old layout; .* \{draft: \{family: eagle3, ttt_steps: 2\}\}"):
        load_recipe(write(tmp_path, "name: x\ndata: {mix: m.yaml}\neagle3: {ttt_steps: 2}\n"))


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ("draft: {family: medusa}\nexport: {format: sglang}", r"export\.format 'sglang': the medusa family writes"),
        ("draft: {family: medusa}\ntraining: {init_from: x}", r"training\.init_from: medusa drafts start fresh"),
        ("eval: {mode: tree, tree: {shape: measured}}", r"eval\.tree\.shape 'measured': eagle3 drafts grow"),
        (
            "draft: {family: eagle3, norm_before_residual: true}\nexport: {format: sglang}",
            r"SGLang's LlamaForCausalLMEagle3 only implements false",
        ),
        ("target: {aux_layer_ids: [2, 15]}", r"target\.aux_layer_ids \[2, 15\]: an EAGLE-3 draft reads exactly 3"),
        (
            "draft: {family: eagle3, norm_output: true}\nexport: {format: gguf}",
            r"draft\.norm_output true: llama\.cpp feeds the pre-norm output back",
        ),
        (
            "draft: {family: eagle3, norm_before_fc: true}\nexport: {format: sglang}",
            r"draft\.norm_before_fc true: SGLang's LlamaForCausalLMEagle3 has no norm before fc",
        ),
        ("draft: {family: eagle3, loss: kl}", r"draft\.loss: Input should be 'ce', .*'lk' or 'lk_hybrid' \(got 'kl'\)"),
        (
            "draft: {family: mtp}\nexport: {format: speculators}",
            r"draft\.style 'deepseek': export\.format 'speculators' \(MTPDraftModel\) runs the head as 'qwen3_next'",
        ),
    ],
    ids=[
        "medusa-sglang",
        "medusa-init-from",
        "eagle3-measured-tree",
        "sglang-norm-before-residual",
        "eagle3-three-aux-ids",
        "gguf-norm-output",
        "sglang-norm-before-fc",
        "eagle3-unknown-loss",
        "mtp-style-for-speculators",
    ],
)
def test_family_rules_are_checked_when_the_recipe_loads(tmp_path, sections, message):
    path = write(tmp_path, f"name: x\ndata: {{mix: m.yaml}}\n{sections}\n")
    with pytest.raises(UserError, match=message) as err:
        load_recipe(path)
    # One line naming the file and the keys, not pydantic's dump of the whole recipe.
    assert str(err.value).splitlines()[1].startswith(f"  {path}: ") and "(got {" not in str(err.value)


@pytest.mark.parametrize("stage", [0, 4])
def test_deepspeed_stage_must_be_one_two_or_three(tmp_path, stage):
    path = write(tmp_path, f"name: x\ndata: {{mix: m.yaml}}\ntraining: {{deepspeed: {{zero_stage: {stage}}}}}\n")
    with pytest.raises(UserError, match=r"training\.deepspeed\.zero_stage"):
        load_recipe(path)


def test_max_length_must_leave_room_for_the_ttt_unroll(tmp_path):
    path = write(tmp_path, "name: x\ndata: {mix: m.yaml, max_length: 8}\ndraft: {family: eagle3, ttt_steps: 7}\n")
    with pytest.raises(UserError, match=r"data\.max_length \(8\) must exceed draft\.ttt_steps \+ 1 \(8\)"):
        load_recipe(path)


def test_deepspeed_and_fsdp_together_are_refused(tmp_path):
    path = write(tmp_path, "name: x\ndata: {mix: m.yaml}\ntraining: {deepspeed: {zero_stage: 2}, fsdp: {}}\n")
    with pytest.raises(UserError, match=r"training\.deepspeed and training\.fsdp are both set"):
        load_recipe(path)
    path = write(tmp_path, "name: x\ndata: {mix: m.yaml}\ntraining: {fsdp: {reshard_after_forwad: false}}\n")
    with pytest.raises(UserError, match=r"training\.fsdp\.reshard_after_forwad"):
        load_recipe(path)


@pytest.mark.parametrize(
    ("name", "strategy"),
    [
        ("ddp", ("multi_gpu", None)),
        ("zero2", ("use_deepspeed", 2)),
        ("zero3", ("use_deepspeed", 3)),
        ("fsdp2", ("use_fsdp", 2)),
    ],
)
def test_launch_configs_read_by_accelerate_launch_start_the_strategy_they_name(name, strategy):
    """accelerate's own `launch` argument handling reads each shipped config: two machines, a static rendezvous at
    machine 0's address, and the distributed type (with ZeRO's stage, FSDP's version) docs/guide/stages.md says."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    parsed = launch_command_parser().parse_args(["--config_file", str(REPO / "launch" / f"{name}.yaml"), "-m", "x"])
    args, *_ = _validate_launch_command(parsed)
    flag, level = strategy
    flags = {"multi_gpu": args.multi_gpu, "use_deepspeed": args.use_deepspeed, "use_fsdp": args.use_fsdp}
    assert [k for k, v in flags.items() if v] == [flag]
    assert (args.num_machines, args.rdzv_backend, args.main_process_port) == (2, "static", 29500)
    if flag == "use_deepspeed":
        assert args.zero_stage == level
    if flag == "use_fsdp":
        assert int(args.fsdp_version) == level
    assert sorted(p.stem for p in (REPO / "launch").glob("*.yaml")) == ["ddp", "fsdp2", "zero2", "zero3"]
