"""Benchmark OSD log ingestion on hostile logs: 20 MB token-like lines among ordinary chat lines.

    .venv/bin/python eval/bench_ingest.py                    # a 1024 MB log, and a 256 MB one for the ratio
    .venv/bin/python eval/bench_ingest.py --size-mb 256 --dir /data/tmp

Writes a JSONL log of `--size-mb` MB in a temporary directory (or under `--dir`): lines whose message holds a
`--token-mb` MB hex or base64 token (a checksum, an inlined file), each followed by ordinary chat lines (some with an
e-mail or an API key to redact). Then runs one ingestion pass (LogIngestor with the built-in redaction, segments
fsynced and committed as in production) and reports MB, seconds, MB/s, records and quarantined lines. The same is done
at a quarter of the size: ingestion is linear in the bytes, so the time ratio should equal the size ratio, about 4 (a
quadratic redaction would give 16; sizes are whole token lines with their chat lines, so the ratio is not exactly 4).
Prints one JSON line and a table.

    .venv/bin/python eval/bench_ingest.py --files 10000     # many small files: 10,000 and 2,500 of them

`--files N`: N log files of `--lines` chat lines each (distinct names, `app-00001.jsonl`, ...), one pass at N and one
at N / 4: a pass is linear in the number of files too, so the time ratio should be about 4.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import platform
import resource
import shutil
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from speculators_train.errors import UserError, run_script
from speculators_train.osd.ingest import LogIngestor
from speculators_train.osd.redact import Redactor

CHAT_LINES_PER_TOKEN = 200


def chat_line(i: int) -> str:
    user = f"Request {i}: sort a list of {i % 97} items in Python; mail me at user{i}@example.com."
    if i % 10 == 0:
        user += " My key is sk-" + f"{i:08d}" * 3
    return json.dumps({"id": f"req-{i}", "messages": [{"role": "user", "content": user}], "response": "sorted(xs)"})


def token_line(i: int, token_bytes: int) -> str:
    """A message holding one token-like run: hex, or base64 with its + / = characters."""
    raw = os.urandom(token_bytes // 2 if i % 2 == 0 else token_bytes * 3 // 4)
    token = raw.hex() if i % 2 == 0 else base64.b64encode(raw).decode()
    content = f"checksum of the upload: {token}"
    return json.dumps({"id": f"tok-{i}", "messages": [{"role": "user", "content": content}], "response": "ok"})


def write_log(path: Path, size: int, token_bytes: int) -> None:
    written, i, n = 0, 0, 0
    with open(path, "w") as fh:
        while written < size:
            line = token_line(i, token_bytes) + "\n"
            fh.write(line)
            written += len(line)
            i += 1
            for _ in range(CHAT_LINES_PER_TOKEN):
                line = chat_line(n) + "\n"
                fh.write(line)
                written += len(line)
                n += 1


def one_pass(where: Path, size_mb: float, token_mb: float) -> dict:
    logs = where / "logs"
    logs.mkdir(parents=True)
    write_log(logs / "app.jsonl", int(size_mb * 2**20), int(token_mb * 2**20))
    size = (logs / "app.jsonl").stat().st_size
    ingestor = LogIngestor(logs, where / "state", Redactor([], True))
    start = time.perf_counter()
    stats = ingestor.run()
    seconds = time.perf_counter() - start
    return {
        "mb": size / 2**20,
        "seconds": seconds,
        "mb_per_s": size / 2**20 / seconds,
        "records": stats.records,
        "quarantined": stats.quarantined,
    }


def files_pass(where: Path, files: int, lines: int) -> dict:
    logs = where / "logs"
    logs.mkdir(parents=True)
    n = 0
    for f in range(files):
        with open(logs / f"app-{f:05d}.jsonl", "w") as fh:
            for _ in range(lines):
                fh.write(chat_line(n) + "\n")
                n += 1
    ingestor = LogIngestor(logs, where / "state", Redactor([], True))
    start = time.perf_counter()
    stats = ingestor.run()
    seconds = time.perf_counter() - start
    return {"files": files, "seconds": seconds, "files_per_s": files / seconds, "records": stats.records}


def many_files(files: int, lines: int, parent: Path | None) -> None:
    runs = {}
    for label, count in (("quarter", max(files // 4, 1)), ("full", files)):
        with tempfile.TemporaryDirectory(dir=parent) as tmp:
            runs[label] = files_pass(Path(tmp), count, lines)
    ratio = runs["full"]["seconds"] / runs["quarter"]["seconds"]
    size_ratio = runs["full"]["files"] / runs["quarter"]["files"]
    result = {
        "files": files,
        "lines_per_file": lines,
        "runs": runs,
        "time_ratio_full_over_quarter": ratio,
        "files_ratio_full_over_quarter": size_ratio,
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(result))
    table = Table(title=f"OSD ingestion of many small log files ({lines} lines each)")
    for column in ("run", "files", "seconds", "files/s", "records"):
        table.add_column(column, justify="right")
    for label, run in runs.items():
        table.add_row(
            label, str(run["files"]), f"{run['seconds']:.1f}", f"{run['files_per_s']:.0f}", str(run["records"])
        )
    console = Console(stderr=True)
    console.print(table)
    console.print(f"full / quarter: {ratio:.2f}x the time for {size_ratio:.2f}x the files (linear: equal)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=1024, help="size of the large log (the small one is 1/4)")
    parser.add_argument("--token-mb", type=float, default=20, help="size of each token-like line")
    parser.add_argument("--dir", help="where to write the logs and the ingestion state (default: a temp dir)")
    parser.add_argument("--files", type=int, help="many small files instead: this many (and a quarter as many)")
    parser.add_argument("--lines", type=int, default=2, help="with --files: chat lines per file")
    args = parser.parse_args()
    if args.size_mb <= 0 or args.token_mb <= 0 or (args.files is not None and (args.files < 1 or args.lines < 1)):
        raise UserError("--size-mb, --token-mb, --files and --lines must be positive")
    parent = Path(args.dir) if args.dir else None
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    if args.files is not None:
        many_files(args.files, args.lines, parent)
        return
    needed = 2.6 * args.size_mb * 2**20  # the logs and their segments, at both sizes
    free = shutil.disk_usage(parent or tempfile.gettempdir()).free
    if free < needed:
        raise UserError(
            f"{parent or tempfile.gettempdir()}: {free / 2**30:.1f} GiB free, about "
            f"{needed / 2**30:.1f} GiB needed; pass --dir or a smaller --size-mb"
        )
    runs = {}
    for label, size_mb in (("quarter", args.size_mb / 4), ("full", args.size_mb)):
        with tempfile.TemporaryDirectory(dir=parent) as tmp:
            runs[label] = one_pass(Path(tmp), size_mb, args.token_mb)
    result = {
        "size_mb": args.size_mb,
        "token_mb": args.token_mb,
        "runs": runs,
        "time_ratio_full_over_quarter": runs["full"]["seconds"] / runs["quarter"]["seconds"],
        "size_ratio_full_over_quarter": runs["full"]["mb"] / runs["quarter"]["mb"],  # logs are whole token blocks
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps(result))
    table = Table(title=f"OSD ingestion of logs with {args.token_mb:g} MB token lines")
    for column in ("run", "MB", "seconds", "MB/s", "records", "quarantined"):
        table.add_column(column, justify="right")
    for label, run in runs.items():
        table.add_row(
            label,
            f"{run['mb']:.0f}",
            f"{run['seconds']:.1f}",
            f"{run['mb_per_s']:.1f}",
            str(run["records"]),
            str(run["quarantined"]),
        )
    console = Console(stderr=True)
    console.print(table)
    time_ratio, size_ratio = result["time_ratio_full_over_quarter"], result["size_ratio_full_over_quarter"]
    console.print(f"full / quarter: {time_ratio:.2f}x the time for {size_ratio:.2f}x the bytes (linear: equal)")


if __name__ == "__main__":
    run_script(main)
