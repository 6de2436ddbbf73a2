"""The hostile-input catalogue of the data path: `speculators-train data RECIPE` on damaged, odd or malicious data
files and mixes. Each case either refuses with one clean line naming the file (and line where it applies) or counts
a skip with its `file:line` and reads every other record; never a traceback, never silently wrong data.

Data files are written beside the mix and named by a relative path, so messages show `data.jsonl:2`, short enough
that the console never wraps inside it. `speculators-train data` reads no model: these cases run in seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from speculators_train.cli import main
from speculators_train.data.mix import load_mix
from tests.conftest import REPO, make_recipe
from tests.faults import clean_error


def good(i: int) -> dict:
    return {
        "id": f"g{i}",
        "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}],
    }


def line(record) -> bytes:
    return json.dumps(record).encode()


def chat(*turns, **extra) -> dict:
    """An OpenAI-style record from (role, content) pairs."""
    return {"id": "x", "messages": [{"role": r, "content": c} for r, c in turns], **extra}


QA = (("user", "q"), ("assistant", "a"))
QA_A = {"role": "assistant", "content": "a"}
DEEP = 100_000


def run_data(tmp_path: Path, capsys, files: dict[str, bytes], sources: list[dict] | None = None):
    """Write `files` beside a recipe whose mix reads them (one source each unless `sources` is given), run
    `speculators-train data` and return (exit code, counts printed on stdout or None, stderr on one line)."""
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    if sources is None:
        sources = [{"name": Path(name).stem, "path": name} for name in files]
    recipe = make_recipe(tmp_path, sources)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["data", str(recipe)])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    code = int(exit_info.value.code or 0)
    return code, json.loads(out) if code == 0 else None, " ".join(err.split())


# --- one hostile JSONL line between two good ones: a counted skip at data.jsonl:2, the good records are read ---

SKIPPED_LINES = {
    "image-and-blank-text-parts": (
        line(chat(("user", [{"type": "text", "text": " "}, {"type": "image_url", "image_url": {}}]), QA[1])),
        "non_text_content",
    ),
    "audio-only-assistant-turn": (line(chat(QA[0], ("assistant", [{"type": "input_audio"}]))), "non_text_content"),
    "text-part-not-a-string": (line(chat(("user", [{"type": "text", "text": 5}]), QA[1])), "bad_field"),
    "list-nested-100k-deep": (b"[" * DEEP + b"]" * DEEP, "nested_too_deeply"),
    "object-nested-100k-deep": (b'{"a":' * DEEP + b"1" + b"}" * DEEP, "nested_too_deeply"),
    "deep-value-inside-a-good-record": (
        line(chat(*QA))[:-1] + b', "meta": ' + b"[" * DEEP + b"]" * DEEP + b"}",
        "nested_too_deeply",
    ),
    "invalid-utf8-byte": (line(chat(("user", "cafe"), QA[1])).replace(b"cafe", b"caf\xe9"), "invalid_utf8"),
    "truncated-utf8-sequence": (b'{"id": "x", "messages": "\xe2\x82"}', "invalid_utf8"),
    "integer-of-5000-digits": (b'{"id": ' + b"7" * 5000 + b', "messages": []}', "number_too_long"),
    "corrupt-json": (b'{"id": "x", "messages": [}', "corrupt_json_line"),
    "nul-bytes-in-line": (b'{"id": "x\x00\x00", "messages": []}', "corrupt_json_line"),
    "nul-padding-line": (b"\x00" * 64, "corrupt_json_line"),
    "record-is-a-list": (b'[{"role": "user", "content": "q"}]', "not_an_object"),
    "record-is-a-string": (b'"hello"', "not_an_object"),
    "record-is-null": (b"null", "not_an_object"),
    "record-is-a-number": (b"42", "not_an_object"),
    "no-messages-field": (b'{"id": "x", "text": "plain"}', "no_conversations_or_messages_field"),
    "messages-is-a-string": (b'{"id": "x", "messages": "hi"}', "bad_field"),
    "messages-is-an-object": (b'{"id": "x", "messages": {"role": "user"}}', "bad_field"),
    "sharegpt-conversations-is-an-object": (b'{"id": "x", "conversations": {"from": "human"}}', "bad_field"),
    "message-is-not-an-object": (b'{"id": "x", "messages": ["hi", "there"]}', "bad_field"),
    "role-missing": (line({"id": "x", "messages": [{"content": "q"}, QA_A]}), "unknown_role"),
    "role-unknown": (line(chat(("robot", "q"), QA[1])), "unknown_role"),
    "role-is-a-deep-list": (
        line({"messages": [{"role": "user", "content": "q"}]})[:-2] + b', {"role": ' + b"[" * 200 + b"]" * 200 + b"}]}",
        "unknown_role",
    ),
    "content-null": (line(chat(("user", None), QA[1])), "bad_field"),
    "content-number": (line(chat(("user", 3.5), QA[1])), "bad_field"),
    "content-object": (line(chat(("user", {"text": "q"}), QA[1])), "bad_field"),
    "sharegpt-value-missing": (
        b'{"id": "x", "conversations": [{"from": "human"}, {"from": "gpt", "value": "a"}]}',
        "bad_field",
    ),
    "lone-surrogate-in-content": (
        b'{"id": "x", "messages": [{"role": "user", "content": "q\\ud800"}, {"role": "assistant", "content": "a"}]}',
        "lone_surrogate",
    ),
    "lone-surrogate-in-id": (line(chat(*QA)).replace(b'"x"', b'"\\udfff"'), "lone_surrogate"),
    "system-only": (line(chat(("system", "You are terse."))), "no_assistant_turn"),
    "user-only": (line(chat(("user", "anyone there?"))), "no_assistant_turn"),
    "empty-conversation": (b'{"id": "x", "messages": []}', "empty_conversation"),
    "duplicate-string-id": (line({**good(0), "messages": good(9)["messages"]}), "duplicate_id"),
}


@pytest.mark.parametrize(("hostile", "reason"), SKIPPED_LINES.values(), ids=list(SKIPPED_LINES))
def test_hostile_jsonl_line_is_a_counted_skip_with_file_and_line(tmp_path, capsys, hostile, reason):
    data = line(good(0)) + b"\n" + hostile + b"\n" + line(good(1)) + b"\n"
    code, counts, err = run_data(tmp_path, capsys, {"data.jsonl": data})
    assert code == 0, err
    assert counts["train"] + counts["held_out"] == 2, (counts, err)
    assert counts["skipped"] == {reason: 1}, (counts, err)
    assert f"skipped 1: {reason} (e.g. data.jsonl:2" in err, err


def test_image_only_turn_is_read_and_skipped_for_a_text_target(tmp_path, capsys):
    """A turn of images alone is a record (a multimodal target reads it through its processor, tests/test_targets.py);
    rendered for the default text-only target it is a counted skip naming its line."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    data = line(good(0)) + b"\n" + line(chat(("user", [image]), QA[1])) + b"\n" + line(good(1)) + b"\n"
    code, counts, err = run_data(tmp_path, capsys, {"data.jsonl": data})
    assert code == 0, err
    assert counts["train"] + counts["held_out"] == 3 and counts["samples"]["train"] + counts["samples"]["held_out"] == 2
    assert counts["skipped"] == {"non_text_content": 1}, (counts, err)
    assert "skipped 1: non_text_content (e.g. data.jsonl:2" in err, err


# --- odd but valid files: every record is read, nothing is skipped ---


def test_bom_at_file_start_and_before_a_joined_file(tmp_path, capsys):
    data = b"\xef\xbb\xbf" + line(good(0)) + b"\n" + b"\xef\xbb\xbf" + line(good(1)) + b"\n"
    code, counts, err = run_data(tmp_path, capsys, {"data.jsonl": data})
    assert code == 0 and counts["train"] + counts["held_out"] == 2 and counts["skipped"] == {}, err


def test_bom_before_a_json_array(tmp_path, capsys):
    data = b"\xef\xbb\xbf" + json.dumps([good(0), good(1)], indent=1).encode()
    code, counts, err = run_data(tmp_path, capsys, {"data.json": data})
    assert code == 0 and counts["train"] + counts["held_out"] == 2 and counts["skipped"] == {}, err


def test_crlf_line_endings(tmp_path, capsys):
    data = b"".join(line(good(i)) + b"\r\n" for i in range(3))
    code, counts, err = run_data(tmp_path, capsys, {"data.jsonl": data})
    assert code == 0 and counts["train"] + counts["held_out"] == 3 and counts["skipped"] == {}, err


def test_integer_and_string_ids_of_the_same_digits_are_two_records(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({**good(0), "id": 7}) + "\n" + json.dumps({**good(1), "id": "7"}) + "\n")
    split = load_mix(make_mix(tmp_path, [{"name": "s", "path": "data.jsonl"}]), 0.0)
    assert sorted(c.id for c in split.train) == ["s:7", "s:7:int"] and split.report.total == 0


def test_empty_or_boolean_ids_name_nothing_and_never_collide(tmp_path):
    path = tmp_path / "data.jsonl"
    records = [{**good(0), "id": ""}, {**good(1), "id": ""}, {**good(2), "id": True}, {**good(3), "id": False}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    split = load_mix(make_mix(tmp_path, [{"name": "s", "path": "data.jsonl"}]), 0.0)
    assert len({c.id for c in split.train}) == 4 and split.report.total == 0


def test_mixed_text_and_image_parts_keep_the_text(tmp_path):
    parts = [
        {"type": "text", "text": "What is "},
        {"type": "image_url", "image_url": {}},
        {"type": "text", "text": "?"},
    ]
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(chat(("user", parts), ("assistant", "A cat."))) + "\n")
    split = load_mix(make_mix(tmp_path, [{"name": "s", "path": "data.jsonl"}]), 0.0)
    assert split.train[0].messages[0] == {"role": "user", "content": "What is ?"}


def test_conversation_ending_with_a_user_turn_is_kept(tmp_path, capsys):
    data = line(chat(*QA, ("user", "and then?"))) + b"\n"
    code, counts, err = run_data(tmp_path, capsys, {"data.jsonl": data})
    assert code == 0 and counts["train"] + counts["held_out"] == 1 and counts["skipped"] == {}, err


def test_very_long_single_line_without_newline(tmp_path, capsys):
    data = line(good(0)) + b"\n" + line(chat(("user", "q"), ("assistant", "w " * 2_500_000)))
    code, counts, err = run_data(tmp_path, capsys, {"data.jsonl": data})
    assert code == 0 and counts["train"] + counts["held_out"] == 2 and counts["skipped"] == {}, err


def test_very_long_unterminated_last_line_is_a_truncated_skip(tmp_path, capsys):
    data = line(good(0)) + b"\n" + b'{"id": "cut", "messages": [{"role": "user", "content": "' + b"w " * 2_500_000
    code, counts, err = run_data(tmp_path, capsys, {"data.jsonl": data})
    assert code == 0 and counts["skipped"] == {"truncated_last_line": 1}, err
    assert "truncated_last_line (e.g. data.jsonl:2" in err


# --- JSON array files: one bad element is skipped by its line when its end is known ---

ARRAY_ELEMENTS = {
    "element-nested-100k-deep": (b"[" * DEEP + b"]" * DEEP, "nested_too_deeply"),
    "element-with-a-deep-field": (
        b'{"id": "d", "x": ' + b'{"a":' * DEEP + b"1" + b"}" * DEEP + b"}",
        "nested_too_deeply",
    ),
    "element-integer-of-5000-digits": (b"9" * 5000, "number_too_long"),
    "element-with-invalid-utf8-in-a-string": (
        line(chat(("user", "cafe"), QA[1])).replace(b"cafe", b"caf\xc3"),
        "invalid_utf8",
    ),
    "element-is-null": (b"null", "not_an_object"),
}


@pytest.mark.parametrize(("element", "reason"), ARRAY_ELEMENTS.values(), ids=list(ARRAY_ELEMENTS))
def test_bad_json_array_element_is_a_counted_skip_with_its_line(tmp_path, capsys, element, reason):
    data = b"[\n" + line(good(0)) + b",\n" + element + b",\n" + line(good(1)) + b"\n]\n"
    code, counts, err = run_data(tmp_path, capsys, {"data.json": data})
    assert code == 0, err
    assert counts["train"] + counts["held_out"] == 2 and counts["skipped"] == {reason: 1}, (counts, err)
    assert f"{reason} (e.g. data.json:3" in err, err


# --- refusals: one clean `error:` line naming the file, and the line where it applies ---

REFUSED_FILES = {
    "empty-file": (b"", ["data.jsonl: file is empty", "no usable records"]),
    "whitespace-only-file": (b"\n \r\n\t\n", ["data.jsonl: file is empty"]),
    "binary-garbage": (b"\x89PNG\r\n\x1a\n" + bytes(range(256)), ["expected a JSON array or JSONL", "b'\\x89PNG"]),
    "gzip-file": (b"\x1f\x8b\x08\x00" + bytes(64), ["expected a JSON array or JSONL", "b'\\x1f\\x8b"]),
    "top-level-number": (b"42\n", ["data.jsonl: expected a JSON array or JSONL", "starts with b'42"]),
    "top-level-string": (b'"records"\n', ["data.jsonl: expected a JSON array or JSONL", "starts with b'\"records"]),
    "yaml-instead-of-json": (b"- role: user\n", ["data.jsonl: expected a JSON array or JSONL"]),
    "every-line-bad": (b"{oops\n{nope\n", ["no usable records", "corrupt_json_line", "data.jsonl:1"]),
}


@pytest.mark.parametrize(("data", "needles"), REFUSED_FILES.values(), ids=list(REFUSED_FILES))
def test_unreadable_data_file_is_one_clean_error(tmp_path, capsys, data, needles):
    code, _, err = run_data(tmp_path, capsys, {"data.jsonl": data})
    assert code == 2 and err.count("error:") == 1, err
    for needle in needles:
        assert needle in err, err


def test_invalid_byte_between_json_array_records_names_line_and_column(tmp_path, capsys):
    data = b"[\n" + line(good(0)) + b",\n  \xff" + line(good(1)) + b"\n]\n"
    code, _, err = run_data(tmp_path, capsys, {"data.json": data})
    assert code == 2 and "data.json:3: not valid UTF-8 in record 1 (byte 0xff at column 3)" in err, err


def test_two_json_arrays_joined_is_refused(tmp_path, capsys):
    data = json.dumps([good(0)]).encode() + b"\n" + json.dumps([good(1)]).encode()
    code, _, err = run_data(tmp_path, capsys, {"data.json": data})
    assert code == 2 and "data.json:2: data after the JSON array's closing ']'" in err, err


def test_data_path_that_is_a_directory(tmp_path, capsys):
    (tmp_path / "data.jsonl").mkdir()
    recipe = make_recipe(tmp_path, [{"name": "s", "path": "data.jsonl"}])
    clean_error(["data", recipe], capsys, "sources.s.path", "data.jsonl is not a file")


def test_corrupt_parquet_file(tmp_path, capsys):
    code, _, err = run_data(tmp_path, capsys, {"data.parquet": b"PAR1" + bytes(200)})
    assert code == 2 and "error: data.parquet: parquet file:" in err, err


def test_corrupt_csv_file(tmp_path, capsys):
    code, _, err = run_data(tmp_path, capsys, {"data.csv": b'messages,id\n"[{oops\n'})
    assert code == 2 and "error: data.csv: csv file:" in err and "EOF inside string" in err, err


# --- the mix YAML itself ---


def make_mix(tmp_path: Path, sources: list[dict], **extra) -> Path:
    path = tmp_path / "mix.yaml"
    path.write_text(yaml.safe_dump({"seed": 0, "sources": sources, **extra}))
    return path


MIX_ERRORS = {
    "missing-data-file": (
        [{"name": "s", "path": "nowhere.jsonl"}],
        {},
        ["sources.s.path", "'nowhere.jsonl' not found"],
    ),
    "package-not-installed": ([{"name": "s", "path": "pkg:no_such_pkg/d.json"}], {}, ["package 'no_such_pkg'"]),
    "unknown-source-key": ([{"name": "s", "path": "data.jsonl", "wieght": 2}], {}, ["wieght", "unknown key"]),
    "negative-weight": ([{"name": "s", "path": "data.jsonl", "weight": -1}], {}, ["weight", "greater than 0"]),
    "infinite-weight": ([{"name": "s", "path": "data.jsonl", "weight": float("inf")}], {}, ["weight", "finite"]),
    "weights-overflow": (
        [{"name": "a", "path": "data.jsonl", "weight": 1e308}, {"name": "b", "path": "data.jsonl", "weight": 1e308}],
        {"total_records": 10},
        ["too large to compute shares"],
    ),
    "total-records-huge": ([{"name": "s", "path": "data.jsonl"}], {"total_records": 10**400}, ["total_records"]),
    "negative-max-records": ([{"name": "s", "path": "data.jsonl", "max_records": -5}], {}, ["max_records"]),
    "zero-max-records": ([{"name": "s", "path": "data.jsonl", "max_records": 0}], {}, ["max_records"]),
    "neither-path-nor-hub": ([{"name": "s"}], {}, ["give exactly one of path or hub"]),
    "no-sources": ([], {}, ["sources"]),
    "duplicate-source-names": ([{"name": "s", "path": "data.jsonl"}] * 2, {}, ["source names must be unique"]),
    "hub-dataset-offline": ([{"name": "h", "hub": "no-org/no-dataset"}], {}, ["no-org/no-dataset: dataset split"]),
}


@pytest.mark.parametrize(("sources", "extra", "needles"), MIX_ERRORS.values(), ids=list(MIX_ERRORS))
def test_bad_mix_is_one_clean_error(tmp_path, capsys, sources, extra, needles):
    (tmp_path / "data.jsonl").write_text(json.dumps(good(0)) + "\n")
    recipe = make_recipe(tmp_path, [{"name": "placeholder", "path": "data.jsonl"}])
    make_mix(tmp_path, sources, **extra)  # the recipe's mix, rewritten as the case needs
    clean_error(["data", recipe], capsys, *needles)


def test_mix_yaml_that_is_not_a_mapping(tmp_path, capsys):
    recipe = make_recipe(tmp_path, [{"name": "s", "path": "data.jsonl"}])
    (tmp_path / "mix.yaml").write_text("- just\n- a list\n")
    clean_error(["data", recipe], capsys, "mix.yaml")


# --- a record far longer than max_length: tokenising it costs what max_length does, not what the record does ---

MEMORY_PROBE = textwrap.dedent(
    """
    import json, resource, sys, time
    from transformers import AutoTokenizer
    from speculators_train.data.chat import Chat
    from speculators_train.data.conversations import Conversation, SkipReport
    from speculators_train.data.render import render
    from speculators_train.recipe import TargetConfig
    from speculators_train.origin import resolve_origin

    tokenizer = Chat(AutoTokenizer.from_pretrained(resolve_origin(TargetConfig())[0]))
    words = "The quick brown fox, 1234 jumps; over the lazy dog!\\n    Déjà vu 🙂 naïve ## ===".split(" ")
    content = " ".join(words[i % len(words)] for i in range(4_000_000))[: int(sys.argv[1])]
    conv = Conversation("s:big", ({"role": "user", "content": "Summarise."}, {"role": "assistant", "content": content}),
                        "big.jsonl:1")
    small = Conversation("s:1", ({"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}), "s")
    render(small, tokenizer, 16, "truncate", SkipReport())  # warm up: the tokenizer's own first-call allocations
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    out = {}
    for overlong in ("truncate", "drop"):
        report = SkipReport()
        samples = render(conv, tokenizer, 128, overlong, report)
        out[overlong] = len(samples[0].input_ids) if samples else None, dict(report.counts)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"delta_mb": (peak - before) / 1024, "seconds": seconds, "out": out}))
    """
)


def test_20mb_record_renders_within_bounded_memory_and_time():
    """A 20 MB assistant turn truncated to 128 tokens used to take +2.7 GB of RSS and 26 s (per-token offsets of
    the whole text); the bound here is generous against machine noise, far below that."""
    size = 20_000_000
    proc = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, str(size)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["out"] == {"truncate": [128, {}], "drop": [None, {"overlong": 1}]}, result
    assert result["delta_mb"] < 1500, result
    assert result["seconds"] < 20, result


# --- records that all render to nothing: `data` and `generate` say why, instead of `train` advising on splits ---


def empty_replies(tmp_path: Path) -> Path:
    """A recipe over six records whose every reply is empty: no record has anything to train on."""
    records = [chat(("user", f"Question {i}?"), ("assistant", ""), id=f"r{i}") for i in range(6)]
    (tmp_path / "data.jsonl").write_bytes(b"\n".join(line(r) for r in records) + b"\n")
    return make_recipe(tmp_path, [{"name": "s", "path": "data.jsonl"}])


def test_a_split_left_without_samples_is_refused_with_the_reasons(tmp_path, capsys):
    """`data` names the split and the skip counts (`generate` does too: tests/integration/test_generator.py)."""
    clean_error(
        ["data", empty_replies(tmp_path)], capsys, "split's", "records gave no sample", "no_reply_after_a_prompt"
    )


def test_image_parts_are_kept_in_order_with_relative_paths_read_beside_the_data(tmp_path):
    """Image parts stay beside the text, in order, for a multimodal target's processor; a relative path is read
    from the data file's folder, and the record's id (its held-out split) does not depend on where that folder is."""
    parts = [
        {"type": "text", "text": "Compare "},
        {"type": "image_url", "image_url": {"url": "pics/a.png"}},
        {"type": "text", "text": " with "},
        {"type": "image", "image": "data:image/png;base64,AAAA"},
        {"type": "input_audio", "input_audio": {}},
    ]
    ids = []
    for folder in (tmp_path / "one", tmp_path / "two"):
        folder.mkdir()
        (folder / "data.jsonl").write_text(json.dumps(chat(("user", parts), ("assistant", "Alike."))) + "\n")
        message = load_mix(make_mix(folder, [{"name": "s", "path": "data.jsonl"}]), 0.0).train[0].messages[0]
        assert message["content"] == "Compare  with "
        assert message["parts"] == [
            {"type": "text", "text": "Compare "},
            {"type": "image", "image": str(folder / "pics" / "a.png")},
            {"type": "text", "text": " with "},
            {"type": "image", "image": "data:image/png;base64,AAAA"},
        ]
        ids.append(load_mix(make_mix(folder, [{"name": "s", "path": "data.jsonl"}]), 0.0).train[0].id)
    assert ids[0] == ids[1]
