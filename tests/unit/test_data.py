"""Readers, role normalisation, mixes and the held-out split, on real ShareGPT and small bad files."""

import json

import pytest

from speculators_train.data.conversations import SkipReport, normalize_record
from speculators_train.data.mix import is_held_out, load_mix
from speculators_train.data.readers import read_file
from speculators_train.errors import UserError
from speculators_train.schema import Section
from tests.conftest import SHAREGPT, write_jsonl

GOOD = {"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}


def read_all(path):
    report = SkipReport()
    records = list(read_file(path, report))
    return records, report


def test_shipped_sharegpt_recovers_every_complete_record():
    path = Section().resolve_path(SHAREGPT, "path")
    records, report = read_all(path)
    assert len(records) == 17671
    assert report.counts == {"truncated_tail": 1}
    assert "cut off" in report.notes[0] and "17671 complete records" in report.notes[0]
    assert records[0][0]["id"] == "QWJhYvA_0" and records[0][1].endswith(":2")


def test_cut_off_json_array_keeps_complete_records(tmp_path):
    text = json.dumps([GOOD, {**GOOD, "id": "b"}, {**GOOD, "id": "c"}], indent=1)
    path = tmp_path / "cut.json"
    path.write_text(text[: text.rindex('"c"') + 2])
    records, report = read_all(path)
    assert [r["id"] for r, _ in records] == ["a", "b"]
    assert report.counts["truncated_tail"] == 1 and "kept the 2 complete records" in report.notes[0]


def test_broken_record_inside_closed_array_is_an_error_with_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[\n{"id": "a", "conversations": []},\n{"id": oops},\n{"id": "c"}\n]\n')
    with pytest.raises(UserError, match=r"bad.json:3: invalid JSON in record 1"):
        read_all(path)


def test_corrupt_jsonl_lines_are_counted_with_file_and_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(GOOD) + "\n{not json\n" + json.dumps({**GOOD, "id": "b"}) + '\n{"id": "cut", "conv')
    records, report = read_all(path)
    assert [r["id"] for r, _ in records] == ["a", "b"]
    assert report.counts == {"corrupt_json_line": 1, "truncated_last_line": 1}
    assert report.examples["corrupt_json_line"][0].startswith(f"{path}:2 ")
    assert report.examples["truncated_last_line"][0].startswith(f"{path}:4 ")


def test_empty_and_non_json_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    records, report = read_all(empty)
    assert records == [] and "file is empty" in report.notes[0]
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(UserError, match=r"notes\.txt: expected a JSON array or JSONL"):
        read_all(text)


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ({"id": "x", "conversations": []}, "empty_conversation"),
        ({"id": "x", "conversations": [{"from": "human", "value": "q"}]}, "no_assistant_turn"),
        ({"id": "x", "conversations": [{"from": "robot", "value": "q"}]}, "unknown_role"),
        ({"id": "x", "conversations": [{"from": "gpt", "value": None}]}, "bad_field"),
        ({"id": "x", "conversations": "text"}, "bad_field"),
        ({"id": "x", "text": "plain"}, "no_conversations_or_messages_field"),
        (["not", "an", "object"], "not_an_object"),
    ],
)
def test_bad_records_are_counted_by_reason(record, reason):
    report = SkipReport()
    assert normalize_record(record, "src", "f.jsonl:7", report) is None
    assert report.counts == {reason: 1}
    assert report.examples[reason][0].startswith("f.jsonl:7")


def test_roles_normalise_across_formats():
    report = SkipReport()
    sharegpt = {
        "id": 1,
        "conversations": [
            {"from": "system", "value": "s"},
            {"from": "human", "value": "q"},
            {"from": "chatgpt", "value": "a"},
            {"from": "user", "value": "q2"},
            {"from": "bard", "value": "a2"},
        ],
    }
    conv = normalize_record(sharegpt, "sg", "o", report)
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert conv.id == "sg:1:int", 'an integer id is typed: it never meets the string id "1"'
    openai = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "c"},
        ]
    }
    conv = normalize_record(openai, "oa", "o", report)
    assert conv.messages[0]["content"] == "ab" and conv.id.startswith("oa:")
    assert normalize_record(openai, "oa", "o", report).id == conv.id, "content-hash ids must be stable"
    assert report.total == 0


def write_mix(tmp_path, sources, **extra):
    import yaml

    path = tmp_path / "mix.yaml"
    path.write_text(yaml.safe_dump({"seed": 0, "sources": sources, **extra}))
    return path


def records(prefix, n):
    return [
        {
            "id": f"{prefix}{i}",
            "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}],
        }
        for i in range(n)
    ]


def test_mix_caps_weights_and_is_deterministic(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", records("a", 100))
    b = write_jsonl(tmp_path / "b.jsonl", records("b", 100))
    mix = write_mix(
        tmp_path, [{"name": "a", "path": str(a), "weight": 3}, {"name": "b", "path": str(b)}], total_records=40
    )
    first = load_mix(mix, 0.0)
    ids = [c.id for c in first.train]
    assert sum(i.startswith("a:") for i in ids) == 30 and sum(i.startswith("b:") for i in ids) == 10
    assert ids == [c.id for c in load_mix(mix, 0.0).train]
    capped = write_mix(tmp_path, [{"name": "a", "path": str(a), "max_records": 7}])
    assert len(load_mix(capped, 0.0).train) == 7


def test_held_out_is_disjoint_and_decided_by_id_alone(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", records("a", 400))
    full = load_mix(write_mix(tmp_path, [{"name": "a", "path": str(a)}]), 0.1)
    train_ids, held_ids = {c.id for c in full.train}, {c.id for c in full.held_out}
    assert not train_ids & held_ids and 15 < len(held_ids) < 70
    # A different cap or seed must never move a held-out record into training.
    small = load_mix(write_mix(tmp_path, [{"name": "a", "path": str(a), "max_records": 150}], seed=5), 0.1)
    assert not {c.id for c in small.train} & held_ids
    assert all(is_held_out(i, 0.1) for i in held_ids)


def test_duplicate_ids_and_empty_mix(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", records("a", 3) + records("a", 1))
    split = load_mix(write_mix(tmp_path, [{"name": "a", "path": str(a)}]), 0.0)
    assert len(split.train) == 3 and split.report.counts["duplicate_id"] == 1
    empty = write_jsonl(tmp_path / "e.jsonl", [{"id": 1, "conversations": []}])
    with pytest.raises(UserError, match=r"no usable records.*empty_conversation"):
        load_mix(write_mix(tmp_path, [{"name": "e", "path": str(empty)}]), 0.0)


def test_a_file_read_again_is_parsed_once_and_its_changes_are_seen(tmp_path, monkeypatch):
    """The parse is shared by content: the same bytes are parsed once (their skips reported each time); a rewrite
    of the same size within the same clock tick is parsed again."""
    from speculators_train.data import mix as mix_module

    parsed = []
    monkeypatch.setattr(mix_module, "_READ", type(mix_module._READ)())
    monkeypatch.setattr(mix_module, "read_file", lambda *a, **k: parsed.append(a[0]) or read_file(*a, **k))
    a = write_jsonl(tmp_path / "a.jsonl", [*records("a", 5), {"id": "x", "conversations": []}])
    mix = write_mix(tmp_path, [{"name": "a", "path": str(a)}])
    first, again = load_mix(mix, 0.0), load_mix(mix, 0.0)
    assert len(parsed) == 1 and [c.id for c in again.train] == [c.id for c in first.train]
    assert first.report.counts == again.report.counts == {"empty_conversation": 1}
    first.train.clear()  # a caller's list is its own
    assert len(load_mix(mix, 0.0).train) == 5 and len(parsed) == 1
    write_jsonl(a, [*records("b", 5), {"id": "x", "conversations": []}])  # same size, same inode
    assert {c.id for c in load_mix(mix, 0.0).train} == {f"a:b{i}" for i in range(5)} and len(parsed) == 2
    monkeypatch.setattr(mix_module, "_READ_MAX_BYTES", 10)  # too large to keep: parsed each time
    load_mix(mix, 0.0), load_mix(mix, 0.0)
    assert len(parsed) == 4


def test_mix_source_needs_exactly_one_location(tmp_path):
    with pytest.raises(UserError, match="give exactly one of path or hub"):
        load_mix(write_mix(tmp_path, [{"name": "a", "path": "x.jsonl", "hub": "org/ds"}]), 0.0)


def test_local_parquet_file_via_datasets(tmp_path):
    import datasets

    path = tmp_path / "chat.parquet"
    datasets.Dataset.from_list(records("p", 5)).to_parquet(str(path))
    split = load_mix(write_mix(tmp_path, [{"name": "pq", "path": str(path)}]), 0.0)
    assert sorted(c.id for c in split.train) == [f"pq:p{i}" for i in range(5)]
    assert split.train[0].origin.startswith(f"{path}[train]#")
