"""The ingestion's `state.json`: its shape, the check of one read back, and the migration of the older format.

Kept apart from the commit protocol (`osd/ingest.py`) so that the one place that knows an earlier state format, and
how its entries map onto today's, can be read (and one day deleted) on its own. A state.json of the older name-keyed
format is migrated on load: each entry goes to the file that now has that name (or a rotated sibling of it) if its
first bytes still hash as recorded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from speculators_train.errors import UserError
from speculators_train.osd.logfiles import LogFile, fingerprints, related, sha

STATE_VERSION = 2


def empty_state() -> dict[str, Any]:
    return {
        "version": STATE_VERSION,
        "files": {},  # "st_dev:st_ino" -> {name, origin, offset, lines, head, tail}
        "retired": [],  # content of files truncated, rewritten or gone: {key, name, origin, offset, lines, head, tail}
        "names": {},  # name -> how many contents have been read under it (origins name, name#2, ...)
        "segments": [],
        "records": 0,
        "quarantined": 0,
    }


def checked(state: Any, path: Path) -> dict[str, Any]:
    """The state loaded from `path`, if it has the shape we write (of this format or the name-keyed one before it)."""
    keys = {"files": dict, "segments": list, "records": int, "quarantined": int}
    if not isinstance(state, dict) or any(not isinstance(state.get(k), t) for k, t in keys.items()):
        raise UserError(
            f"{path}: ingestion state is damaged (expected an object with files, segments, records "
            "and quarantined); move it away to ingest the logs again from the start"
        )
    version = state.get("version")
    shaped = isinstance(state.get("retired"), list) and isinstance(state.get("names"), dict)
    if version is not None and (version != STATE_VERSION or not shaped):
        raise UserError(f"{path}: ingestion state of an unknown version or damaged ({version!r})")
    return state


def migrated(old: dict[str, Any], candidates: list[LogFile], path: Path, notes: list[str]) -> dict[str, Any]:
    """The name-keyed state of earlier versions, keyed by identity: each name goes to the file that now has it, or
    to a rotated sibling of it, whose first bytes still hash as recorded; others are dropped with a note."""
    state = {**empty_state(), "segments": old["segments"], "records": old["records"]}
    state["quarantined"] = old["quarantined"]
    for name, entry in sorted(old["files"].items()):
        state["names"][name] = 1
        same_name = [f for f in candidates if f.name == name]
        siblings = [f for f in candidates if f.name != name and related(f.name, name)]
        for f in same_name + siblings:
            if f.key in state["files"] or f.size < entry["offset"]:
                continue
            with open(f.path, "rb") as fh:
                head, tail = fingerprints(fh.fileno(), entry["offset"])
            if sha(head) == entry.get("head_sha256"):
                content = {"offset": entry["offset"], "lines": entry["lines"], "head": sha(head)}
                origin = name if f.name == name else None
                state["files"][f.key] = {**content, "tail": sha(tail), "name": f.name, "origin": origin}
                break
        else:
            notes.append(f"{name}: in the old ingestion state, but no file starts as it did; its state dropped")
    notes.append(f"{path}: migrated from the name-keyed format ({len(old['files'])} files)")
    return state
