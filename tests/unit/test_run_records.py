"""Run records as input: the verify results, manifests and export configs `export` and `doctor` read back from a run
folder a user may edit, copy from another version or find half-written. Each bad value is a one-line error naming
the file and field, or the record is skipped and counted; nothing grows or waits without bound."""

import json
import math
import os
import time
from types import SimpleNamespace

import pytest

from speculators_train.errors import UserError
from speculators_train.export.k import expected_speedups, loop_record, measured, recommended_k
from speculators_train.export.records import checked_records, record_problem
from speculators_train.export.run import latest_verify_report, serving_k
from speculators_train.families.format_common import proposal_k
from tests.unit.test_doctor_k import RATES, engine_record, record

# (field, value) pairs each of which once raised ZeroDivisionError, TypeError or ValueError in export or doctor, or
# made them loop or allocate without end (a K of a billion)
HOSTILE = [
    ("speedup", 0),
    ("speedup", -1.5),
    ("speedup", None),
    ("speedup", "fast"),
    ("target_only_tokens_per_s", 0),
    ("target_only_tokens_per_s", None),
    ("steps", -4),
    ("steps", "100"),
    ("steps", 2.5),
    ("acceptance_length", 0.3),
    ("acceptance_length", "2"),
    ("num_speculative_tokens", 0),
    ("num_speculative_tokens", -3),
    ("num_speculative_tokens", 10**9),
    ("num_speculative_tokens", True),
    ("per_position_acceptance", [0.5, None]),
    ("per_position_acceptance", [1.5]),
    ("per_position_acceptance", "0.8"),
    ("seconds", {"spec_verify": -1.0}),
    ("seconds", None),
    ("temperature", None),
    ("batch", 0),
    ("batch", 10**9),
]


@pytest.mark.parametrize(("field", "value"), HOSTILE, ids=[f"{f}={v!r}"[:40] for f, v in HOSTILE])
def test_a_record_with_a_value_no_reader_can_compute_with_is_named(field, value):
    good = {**record(RATES), "acceptance_length": 2.0}
    assert record_problem(good) is None
    problem = record_problem({**good, field: value})
    assert problem is not None and f"`{field}`" in problem


def test_float_values_outside_strict_json_are_refused_too():
    for value in (math.nan, math.inf, -math.inf):
        assert "`speedup`" in record_problem({**record(RATES), "speedup": value})


def test_required_fields_and_objects():
    assert record_problem("a string") == "not an object"
    assert record_problem({k: v for k, v in record(RATES).items() if k != "suite"}) == "no `suite`"
    assert "rises" in record_problem(record([0.2, 0.6, 0.1, 0.0]))  # a step accepting 2 drafts accepted 1
    assert "holds 5 rates for K=4" in record_problem(record([0.5] * 5))


def write_run(tmp_path, records) -> SimpleNamespace:
    (tmp_path / "verify" / "1").mkdir(parents=True)
    (tmp_path / "verify" / "1" / "results.json").write_text(json.dumps(records))
    return SimpleNamespace(run_dir=tmp_path)


def test_skipped_records_are_counted_with_the_file_and_index_and_the_rest_still_decide_k(tmp_path):
    ckpt = tmp_path / "ckpt"
    good = {**record([0.9, 0.1, 0.05, 0.0]), "checkpoint": str(ckpt)}
    bad = [{**good, "speedup": 0}, {**good, "num_speculative_tokens": 10**9}, {**good, "steps": None}]
    recipe = write_run(tmp_path, [*bad, good])
    report = latest_verify_report(recipe, ckpt)  # type: ignore[arg-type]
    assert report.records == [good] and len(report.skipped) == 3
    assert report.skipped[0].startswith(f"{report.path}: record 0: `speedup`")
    k, notes = serving_k(recipe, ckpt, "native", 4, False)  # type: ignore[arg-type]
    assert k < 4  # the good record still recommends its measured best
    assert any("3 verify record(s) skipped" in n and "record 0: `speedup`" in n for n in notes), notes


def test_a_report_of_only_bad_records_decides_nothing_and_says_why(tmp_path):
    ckpt = tmp_path / "ckpt"
    recipe = write_run(tmp_path, [{**record(RATES), "checkpoint": str(ckpt), "speedup": "x"}])
    report = latest_verify_report(recipe, ckpt)  # type: ignore[arg-type]
    assert report.records == [] and len(report.skipped) == 1
    k, notes = serving_k(recipe, ckpt, "native", 4, False)  # type: ignore[arg-type]
    assert k == 4 and len(notes) == 1 and "record 0: `speedup` must be a finite number above 0" in notes[0]


def test_a_verify_pass_of_zero_seconds_is_not_a_measurement():
    r = record(RATES, verify=0.0, draft=0.0)
    assert not measured(r) and loop_record([r]) is None
    assert recommended_k([r], 4) is None
    ok = record(RATES)
    assert measured(ok) and all(math.isfinite(s) and s > 0 for s in expected_speedups(ok).values())


def test_an_engine_record_of_a_billion_k_is_skipped_at_once():
    start = time.perf_counter()
    kept, skipped = checked_records(
        "r.json",  # type: ignore[arg-type]
        [engine_record(10**9, RATES, 1.2), {**engine_record(4, RATES, 1.2), "per_position_acceptance": [0.5] * 10**6}],
    )
    assert kept == [] and len(skipped) == 2 and time.perf_counter() - start < 1


@pytest.mark.parametrize("k", [0, -3, 10**9, True, "4", 2.0])
def test_an_export_config_whose_k_no_engine_could_serve_has_no_k(k):
    from speculators_train.families.format_common import proposal_config

    config = {"speculators_config": proposal_config("eagle3", 4, "v", ["A"])}
    assert proposal_k(config) == 4
    config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = k
    assert proposal_k(config) is None  # doctor's fresh write then takes the trained K: "as trained" fails


def manifest_dir(tmp_path, **changes):
    from speculators_train.hidden_states.shards import FORMAT, VERSION

    identity = {"aux_layer_ids": [1, 2], "hidden_size": 8, "vocab_size": 16, "storage_dtype": "float32",
                "data_fingerprint": "f"}  # fmt: skip
    shard = {"file": "s.safetensors", "sha256": "0" * 64, "num_samples": 1, "num_tokens": 3}
    splits = {s: {"shards": [shard]} for s in ("train", "held_out")}
    manifest = {"format": FORMAT, "version": VERSION, "complete": True, "identity": identity, "splits": splits}
    for key, value in changes.items():
        manifest[key] = value
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    return tmp_path


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"identity": None}, "`identity` is missing"),
        ({"identity": "abc"}, "`identity` is not an object"),
        ({"identity": {"hidden_size": 8}}, "`identity.aux_layer_ids`"),
        ({"splits": {"train": "x"}}, "`splits.train.shards`"),
        ({"splits": {"train": {"shards": [{"num_samples": -1}]}, "held_out": {"shards": []}}}, "shards[0]`"),
        ({"token_freq_sha256": 5}, "`token_freq_sha256`"),
    ],
)
def test_a_manifest_a_reader_cannot_compute_with_is_one_line_naming_the_field(tmp_path, changes, field):
    from speculators_train.hidden_states.shards import read_manifest

    assert read_manifest(manifest_dir(tmp_path))["identity"]["hidden_size"] == 8
    with pytest.raises(UserError, match=r"manifest\.json: field ") as err:
        read_manifest(manifest_dir(tmp_path, **changes))
    assert field in str(err.value) and "\n" not in str(err.value)


def test_doctor_reads_a_manifest_without_identity_as_a_skipped_check(tmp_path):
    from speculators_train.doctor.data import check_data, check_verifier

    states = manifest_dir(tmp_path, identity="abc", target_config="also a string")
    [check] = check_data(states, {"tokenizer_hash": "t"}, "float32")
    assert check.status == "skip" and "`identity` is not an object" in check.detail
    now = {"revision": None, "config_hash": "sha256:1"}
    assert check_verifier({"speculators_config": "edited"}, states, now).status == "skip"


def test_doctor_asks_for_a_batch_it_can_hold():
    from speculators_train.doctor.run import DoctorOptions
    from speculators_train.export.records import MAX_BATCH

    assert DoctorOptions(MAX_BATCH).batch == MAX_BATCH
    for batch in (0, MAX_BATCH + 1, 10**6):
        with pytest.raises(UserError, match=f"--batch {batch}: expected 1 to {MAX_BATCH}"):
            DoctorOptions(batch)


def test_a_prompts_file_that_is_a_pipe_is_refused_without_reading_it(tmp_path):
    from speculators_train.doctor.requests import read_requests

    fifo = tmp_path / "prompts.jsonl"
    os.mkfifo(fifo)  # nothing ever writes it: a read would wait forever
    with pytest.raises(UserError, match=r"prompts\.jsonl: a pipe, socket or device, not a file"):
        read_requests(fifo)


def test_request_kwargs_that_are_apply_chat_templates_own_arguments_are_skipped(tmp_path):
    from speculators_train.doctor.requests import read_requests

    messages = [{"role": "user", "content": "hi"}]
    lines = [{"messages": messages, "chat_template_kwargs": {"tokenize": True}},
             {"messages": messages, "chat_template_kwargs": {"add_generation_prompt": False, "enable_thinking": 1}},
             {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}}]  # fmt: skip
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    requests, report = read_requests(path)
    assert [r.kwargs for r in requests] == [{"enable_thinking": False}]
    assert report.counts["bad_field"] == 2 and "chat_template_kwargs.tokenize" in report.examples["bad_field"][0]


def test_a_recipe_cannot_pass_apply_chat_templates_own_arguments_as_template_variables():
    from transformers import AutoTokenizer

    from speculators_train.data.chat import Chat
    from tests.targets import tiny_target

    tokenizer = AutoTokenizer.from_pretrained(tiny_target())
    assert Chat(tokenizer, {"enable_thinking": False}).prompt_ids([{"role": "user", "content": "hi"}])
    with pytest.raises(
        UserError, match=r"data\.chat_template_kwargs: add_generation_prompt: apply_chat_template.s own"
    ):
        Chat(tokenizer, {"add_generation_prompt": False})
