"""OSD log ingestion in children of its own: redaction and a 20 MB line in linear time under a hard timeout (each
adversarial text at two sizes), and kill -9 at every event of a pass after each kind of rotation, rerun until every
line was stored exactly once. The cases without a process are in tests/unit/test_ingest.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.children import run_python
from tests.conftest import sweep
from tests.unit.test_ingest import copytruncate, ids_once_all, ingestor, line, write


def in_child(code: str, timeout: float) -> str:
    """Run `code` in a child process; a hang fails the test at `timeout` instead of stalling the suite."""
    try:
        proc = run_python(code, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running after {timeout} s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


# Adversarial texts for a backtracking engine: long runs of what a pattern's unbounded part accepts, each retried
# from every start position by a naive pattern before it fails on a missing literal.
ADVERSARIAL = {
    "local_part_run": "'a' * n",  # the old e-mail regex: 200 KB took 47 s
    "hex_token": "os.urandom(n // 2).hex()",
    "base64_token": "base64.b64encode(os.urandom(n * 3 // 4)).decode()",
    "at_signs": "'a@' * (n // 2)",
    "domain_dots": "'x@' + '.ab' * (n // 3)",
    "jwt_starts": "'eyJ' * (n // 3)",
    "api_key_prefixes": "'sk-' * (n // 3)",
    "password_labels": "'password=' * (n // 9)",
    "bearer_then_spaces": "'bearer' + ' ' * n + 'x'",
    "json_escapes": "'\\\\u0040' * (n // 6)",
    "secret_labels": "'secret_key=' * (n // 11)",
    "authorization_labels": "'Authorization:' * (n // 14)",
    "digit_run": "'7' * n",
    "spaced_digits": "'1 ' * (n // 2)",
    "dotted_digits": "'1.' * (n // 2)",
    "hex_colons": "'a:' * (n // 2)",
    "url_schemes": "'://a:' * (n // 5)",
    "key_begins": "'-----BEGIN PRIVATE KEY-----' * (n // 27)",
    "cookie_labels": "'cookie:' * (n // 7)",
    "token_labels": "'api_key=' * (n // 8)",
    "plus_digits": "'+1 ' * (n // 3)",
    "upper_pairs": "'AB12' * (n // 4)",
    "fullwidth_text": "'\\uff41' * n",
    "cli_options": "'--password ' * (n // 11)",
    "netrc_machines": "'machine a ' * (n // 10)",
    "aws_labels": "'aws key ' * (n // 8)",
    "percent_escapes": "'%41' * (n // 3)",
    "html_entities": "'&amp;' * (n // 5)",
    "key_bodies": "'MIIEowIBAAKCAQEA ' * (n // 17)",
    "orphan_key_ends": "'-----END PRIVATE KEY-----\\n' * (n // 26)",
    "putty_headers": "'PuTTY-User-Key-File-2\\n' * (n // 22)",
    "pgpass_lines": "'a:1:b:c:d\\n' * (n // 10)",
    "signature_params": "'?sig=' * (n // 5)",
    "vendor_labels": "'cloudant_key ' * (n // 13)",
    "prose_passwords": "'password is ' * (n // 12)",
    "look_alike_words": "'p\\u0430ss ' * (n // 5)",
    "nested_base64": "base64.b64encode(base64.b64encode(('token: Xq81LmZa0pQ7 ' * (n // 44)).encode())).decode()",
}


def test_builtin_redaction_takes_linear_time_on_adversarial_text():
    """Each adversarial text at 256 KB and 2 MB: time grows about 8x (a quadratic rule would take 64x, and hours).
    The best of two runs, and a bound of 32x: caches and a shared machine's neighbours stretch the larger run by up to
    14x in measurements, which a bound of twice the linear ratio failed on."""
    code = f"""
import base64, json, os, time
from speculators_train.osd.redact import Redactor
redact, out = Redactor([], True), {{}}
for name, make in {ADVERSARIAL!r}.items():
    times = []
    for n in (1 << 18, 2 << 20):
        text = eval(make)
        best = float("inf")
        for _ in range(2):
            start = time.perf_counter()
            redact(text)
            best = min(best, time.perf_counter() - start)
        times.append(best)
    out[name] = times
print(json.dumps(out))
"""
    times = json.loads(in_child(code, timeout=480))
    for name, (small, large) in times.items():
        assert large < 20, (name, small, large)
        assert large / max(small, 0.02) < 32, (name, small, large)


def test_a_20_mb_token_line_is_ingested_in_linear_time(tmp_path):
    """One 20 MB hex token inside a message (plus base64 and ordinary lines) goes through a whole pass quickly."""
    code = f"""
import base64, json, os, time
from pathlib import Path
from speculators_train.osd.ingest import LogIngestor
from speculators_train.osd.redact import Redactor
logs = Path({str(tmp_path / "logs")!r})
logs.mkdir()
token = os.urandom(10 << 20).hex()
lines = [
    {{"messages": [{{"role": "user", "content": "checksum " + token}}], "response": "ok"}},
    {{"messages": [{{"role": "user", "content": base64.b64encode(os.urandom(6 << 20)).decode()}}], "response": "ok"}},
    {{"messages": [{{"role": "user", "content": "hi alice@example.com"}}], "response": "hello"}},
]
(logs / "a.jsonl").write_text("".join(json.dumps(x) + "\\n" for x in lines))
start = time.perf_counter()
stats = LogIngestor(logs, Path({str(tmp_path / "state")!r}), Redactor([], True)).run()
print(json.dumps([stats.records, time.perf_counter() - start]))
"""
    records, seconds = json.loads(in_child(code, timeout=120))
    assert records == 3 and seconds < 60


def test_a_users_pattern_with_nested_quantifiers_takes_linear_time():
    """On a backtracking engine `(a+)+$` takes exponential time on 'aaa...b'; the recipe's patterns run on RE2."""
    code = """
import json, time
from speculators_train.osd.redact import Redactor
redact = Redactor(["(a+)+$", "(x|x)*y", "secret-[0-9]+"], False)
start = time.perf_counter()
out = redact("a" * 200_000 + "b " + "x" * 100_000 + " secret-42")
print(json.dumps([time.perf_counter() - start, out.endswith("[REDACTED]")]))
"""
    seconds, redacted = json.loads(in_child(code, timeout=60))
    assert seconds < 5 and redacted


# ---------------------------------------------------------------------------------------------------------------------
# kill -9 at every event of a pass that follows a rotation.

WORKER = """
import os, signal, sys
from pathlib import Path
from speculators_train.osd.ingest import LogIngestor
from speculators_train.osd.redact import Redactor

die_at, seen = int(sys.argv[3]), 0


def dying(fn):
    def wrapped(*args, **kwargs):
        global seen
        seen += 1
        if seen == die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return fn(*args, **kwargs)
    return wrapped


os.fsync, os.replace, Redactor.__call__ = dying(os.fsync), dying(os.replace), dying(Redactor.__call__)
LogIngestor(Path(sys.argv[1]), Path(sys.argv[2]), Redactor([], True), 3).run()
if die_at == 0:
    print(seen)
"""


def killed_pass(logs: Path, root: Path, die_at: int) -> int:
    proc = run_python(WORKER, [logs, root, die_at], timeout=60)
    assert proc.returncode in (0, -signal.SIGKILL), proc.stderr[-3000:]
    return int(proc.stdout) if die_at == 0 else proc.returncode


def rename_rotation(logs: Path) -> None:
    write(logs / "a.jsonl", [line(i) for i in range(8, 12)], "a")
    os.rename(logs / "a.jsonl", logs / "a.jsonl.1")
    write(logs / "a.jsonl", [line(i) for i in range(12, 15)] + ["{broken"])


def copytruncate_rotation(logs: Path) -> None:
    write(logs / "a.jsonl", [line(i) for i in range(8, 12)], "a")
    copytruncate(logs)
    write(logs / "a.jsonl", [line(i) for i in range(12, 15)] + ["{broken"], "a")


def truncate_rotation(logs: Path) -> None:
    write(logs / "a.jsonl", [line(i) for i in range(5)] + [line(i) for i in range(100, 107)] + ["{broken"])


ROTATIONS = {
    "rename": (rename_rotation, list(range(15))),
    "copytruncate": (copytruncate_rotation, list(range(15))),
    "truncate_same_start": (truncate_rotation, list(range(8)) + list(range(5)) + list(range(100, 107))),
}


# The default run kills the pass after a truncation that keeps the file's first lines (the rotation only the
# fingerprint can tell); rename and copytruncate run with SPECULATORS_TRAIN_FULL=1 (tests/unit covers how each is
# detected).
@pytest.mark.parametrize("rotation", sweep(ROTATIONS, ("truncate_same_start",)))
def test_exactly_once_when_a_pass_after_rotation_is_killed_at_each_event(tmp_path, rotation):
    """For every event of the pass after a rotation (each redaction, segment fsync and rename, state fsync and rename),
    a pass killed there, another killed a few events later, then a clean pass: every line stored exactly once."""
    rotate, expected = ROTATIONS[rotation]

    def prepared(where: Path) -> tuple[Path, Path]:
        logs, root = where / "logs", where / "state"
        write(logs / "a.jsonl", [line(i) for i in range(8)])
        ingestor(logs, root, commit_every=3).run()
        rotate(logs)
        return logs, root

    logs, root = prepared(tmp_path / "clean")
    events = killed_pass(logs, root, 0)
    assert events >= 15
    kills = 0
    for die_at in range(1, events + 1):
        logs, root = prepared(tmp_path / f"die-{die_at}")
        kills += killed_pass(logs, root, die_at) == -signal.SIGKILL
        killed_pass(logs, root, 3)  # a second crash, early in the rerun
        ing = ingestor(logs, root)
        ing.run()
        assert sorted(ids_once_all(ing)) == sorted(expected), die_at
        assert ing.state["quarantined"] == 1 and not list((root / "segments").glob("*.tmp"))
    assert kills == events
