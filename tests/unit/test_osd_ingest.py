"""Production-log ingestion for online distillation: every accepted format, quarantine with file:line, a partial
last line left for later, appended lines and new files picked up, rotation, redaction before storage, and
exactly-once under kill -9 and reruns."""

import json
import random
import signal
import sys
from collections import Counter
from pathlib import Path

import pytest

from speculators_train.cli import main
from speculators_train.errors import UserError
from speculators_train.osd.ingest import LogIngestor
from speculators_train.osd.redact import Redactor
from tests.children import run_python
from tests.conftest import SHAREGPT, make_recipe

CHAT = {"messages": [{"role": "user", "content": "Sort a list in Python?"}], "response": "Use sorted(xs)."}
FORMATS = [
    CHAT,
    {  # an OpenAI chat completion logged as is
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "4"}, "finish_reason": "stop"}],
    },
    {  # request and response objects
        "request": {"model": "m", "messages": [{"role": "user", "content": "Hi"}]},
        "response": {"id": "c1", "choices": [{"message": {"role": "assistant", "content": "Hello!"}}]},
    },
    {"prompt": "Translate 'cat' to French.", "completion": "chat"},
    {"prompt": "Capital of Italy?", "response": {"choices": [{"text": "Rome"}]}},
]
BAD = [
    '{"messages": [{"role": "user", "content": "cut',  # invalid JSON (complete line, broken record)
    json.dumps({"messages": [{"role": "wizard", "content": "x"}], "response": "y"}),
    json.dumps({"messages": [], "response": "y"}),
    json.dumps({"prompt": "no answer"}),
    json.dumps(["not", "an", "object"]),
]


def write(path: Path, lines: list[str], mode: str = "w") -> None:
    with open(path, mode) as fh:
        fh.writelines(line + "\n" for line in lines)


def ingestor(logs: Path, root: Path, commit_every: int = 256, **redact) -> LogIngestor:
    return LogIngestor(logs, root, Redactor(redact.get("patterns", []), True, redact.get("hook")), commit_every)


def test_every_format_becomes_a_chat_and_bad_lines_are_quarantined_with_file_and_line(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    write(logs / "a.jsonl", [json.dumps(r) for r in FORMATS[:3]] + ["", *BAD[:3]])
    write(logs / "b.jsonl", [json.dumps(r) for r in FORMATS[3:]] + BAD[3:])
    ing = ingestor(logs, tmp_path / "state")
    stats = ing.run()
    assert (stats.records, stats.quarantined, stats.files) == (5, 5, 2)
    chats = list(ing.conversations())
    assert [c.messages[-1] for c in chats] == [
        {"role": "assistant", "content": text} for text in ("Use sorted(xs).", "4", "Hello!", "chat", "Rome")
    ]
    assert chats[1].messages[0] == {"role": "system", "content": "Be brief."}
    assert [c.origin for c in chats] == ["a.jsonl:1", "a.jsonl:2", "a.jsonl:3", "b.jsonl:1", "b.jsonl:2"]
    quarantined = {e["origin"]: e["quarantined"] for e in ing.entries() if "quarantined" in e}
    assert quarantined["a.jsonl:5"].startswith("invalid_json")  # line 4 is blank: skipped, still counted
    assert quarantined["a.jsonl:6"] == "unknown_role"
    assert quarantined["a.jsonl:7"] == "empty_conversation"
    assert quarantined["b.jsonl:3"] == "no_response"
    assert quarantined["b.jsonl:4"] == "not_an_object"
    assert stats.reasons["invalid_json"] == 1 and sum(stats.reasons.values()) == 5


def test_partial_last_line_waits_and_appended_lines_and_new_files_are_picked_up(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    line = json.dumps(CHAT)
    write(logs / "a.jsonl", [line, line])
    with open(logs / "a.jsonl", "a") as fh:
        fh.write(line[:20])  # a writer is mid-line
    first = ingestor(logs, tmp_path / "state").run()
    assert first.records == 2 and first.pending_bytes == 20
    with open(logs / "a.jsonl", "a") as fh:
        fh.write(line[20:] + "\n" + line + "\n")
    write(logs / "b.jsonl", [line])
    ing = ingestor(logs, tmp_path / "state")
    second = ing.run()
    assert (second.records, second.quarantined, second.pending_bytes) == (3, 0, 0)
    assert [c.origin for c in ing.conversations()] == ["a.jsonl:1", "a.jsonl:2", "a.jsonl:3", "a.jsonl:4", "b.jsonl:1"]
    assert ingestor(logs, tmp_path / "state").run().records == 0  # nothing new: nothing read twice
    assert ing.state["records"] == 5


def test_a_rotated_file_is_read_from_its_start(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    write(logs / "a.jsonl", [json.dumps(CHAT)] * 3)
    ingestor(logs, tmp_path / "state").run()
    other = {**CHAT, "response": "Call list.sort()."}
    write(logs / "a.jsonl", [json.dumps(other)])  # replaced by a new, shorter file of the same name
    ing = ingestor(logs, tmp_path / "state")
    stats = ing.run()
    assert stats.records == 1 and "rotated or rewritten" in stats.notes[0]
    assert [c.messages[-1]["content"] for c in ing.conversations()][-1] == "Call list.sort()."


def test_secrets_and_personal_data_are_redacted_before_anything_is_stored(tmp_path):
    hook = tmp_path / "myhooks.py"
    hook.write_text("def scrub(text):\n    return text.replace('Alice', '[NAME]')\n")
    sys.path.insert(0, str(tmp_path))
    try:
        logs = tmp_path / "logs"
        logs.mkdir()
        secret = "sk-" + "A1b2C3d4E5f6G7h8J9k0"
        record = {
            "messages": [{"role": "user", "content": f"I'm Alice, alice@example.com, key {secret}, card 4111-1111"}],
            "response": "Noted, Alice.",
        }
        broken = json.dumps(record)[:-2] + " alice@example.com"
        write(logs / "a.jsonl", [json.dumps(record), broken])
        root = tmp_path / "state"
        ing = ingestor(logs, root, patterns=[r"\d{4}-\d{4}"], hook="myhooks:scrub")
        assert ing.run().quarantined == 1
        user = next(ing.conversations()).messages[0]["content"]
        assert user == "I'm [NAME], [EMAIL], key [API_KEY], card [REDACTED]"
        stored = "".join(p.read_text() for p in root.rglob("*") if p.is_file())
        for leaked in ("Alice", "alice@example.com", secret, "4111-1111"):
            assert leaked not in stored, leaked
    finally:
        sys.path.remove(str(tmp_path))
    with pytest.raises(UserError, match=r"osd.redact\[0\]: '\(oops' is not an RE2 regex"):
        Redactor(["(oops"])
    with pytest.raises(UserError, match=r"osd\.redact_hook: cannot load 'nowhere:fn'"):
        Redactor([], hook="nowhere:fn")


WORKER = """
import os, signal, sys
from pathlib import Path
from speculators_train.osd.ingest import LogIngestor
from speculators_train.osd.redact import Redactor

die_at, events = int(sys.argv[3]), 0


def dying(fn):
    def wrapped(*args, **kwargs):
        global events
        events += 1
        if events == die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return fn(*args, **kwargs)
    return wrapped


os.fsync, os.replace, Redactor.__call__ = dying(os.fsync), dying(os.replace), dying(Redactor.__call__)
LogIngestor(Path(sys.argv[1]), Path(sys.argv[2]), Redactor([], True), 7).run()
"""


def test_exactly_once_under_kill_minus_9_and_reruns(tmp_path):
    """A writer appends while ingestion passes are killed with SIGKILL at chosen events (a redaction, a segment fsync,
    a rename of a segment or of the state): every crash window of the commit protocol is hit, independent of machine
    speed. After a last clean pass every valid line is stored exactly once and every bad one quarantined once."""
    logs = tmp_path / "logs"
    logs.mkdir()
    rng = random.Random(0)
    lines = []
    for i in range(1500):
        lines.append(json.dumps({**CHAT, "id": i}) if i % 50 else f'{{"broken": {i}')
    write(logs / "a.jsonl", lines[:700])
    write(logs / "b.jsonl", lines[700:900])
    root = tmp_path / "state"
    kills = 0
    for round_ in range(10):
        if round_ == 3:
            write(logs / "a.jsonl", lines[900:1200], "a")
        if round_ == 6:
            write(logs / "c.jsonl", lines[1200:])
        die_at = rng.randint(1, 400)
        proc = run_python(WORKER, [logs, root, die_at], timeout=120)
        assert proc.returncode in (0, -signal.SIGKILL)
        kills += proc.returncode == -signal.SIGKILL
    assert kills >= 6
    ing = ingestor(logs, root)
    ing.run()
    origins = Counter(e["origin"] for e in ing.entries())
    assert max(origins.values()) == 1
    expected = {f"a.jsonl:{n}" for n in range(1, 1001)} | {f"b.jsonl:{n}" for n in range(1, 201)}
    expected |= {f"c.jsonl:{n}" for n in range(1, 301)}
    assert set(origins) == expected
    ids = sorted(int(e["id"].split(":")[1]) for e in ing.entries() if "id" in e)
    assert ids == [i for i in range(1500) if i % 50]
    assert ing.state["records"] == len(ids) and ing.state["quarantined"] == 30
    assert not list((root / "segments").glob("*.tmp"))


def test_osd_command_ingests_and_names_a_missing_logs_dir(tmp_path, capsys):
    recipe = make_recipe(tmp_path, [{"name": "sharegpt", "path": SHAREGPT, "max_records": 8}])
    logs = tmp_path / "logs"
    logs.mkdir()
    write(logs / "a.jsonl", [json.dumps(CHAT), BAD[1]])
    with pytest.raises(SystemExit) as exit_info:
        main(["osd", str(recipe), "--logs", str(logs), "--ingest-only"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().err  # rich prints status to stderr
    assert "ingested 1 new records from 1 files, quarantined 1 (unknown_role 1)" in " ".join(out.split())
    assert (tmp_path / "run" / "osd" / "ingest" / "state.json").is_file()
    with pytest.raises(SystemExit) as exit_info:
        main(["osd", str(recipe)])
    assert exit_info.value.code == 2
    assert "no logs directory: pass --logs DIR or set osd.logs" in " ".join(capsys.readouterr().err.split())
