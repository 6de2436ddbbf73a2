"""A verify run's records as `export` and `doctor` read them back. The results file lives in the run folder, which a
user may edit, copy from another version or find half-written, so each field they compute with is checked before
use: a record that fails is skipped, and counted with the file, the record's index and the field."""

from __future__ import annotations

import math
from itertools import pairwise
from pathlib import Path
from typing import Any

from speculators_train.engines.base import MAX_DRAFT_TOKENS

# The most requests a record may say it sent at once: doctor times the target at each batch a record names.
MAX_BATCH = 1024
MAX_COUNT = 2**53  # steps and tokens: past this a float sum of them is no longer exact


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


# field -> (required, what it must be, the test); a field that is absent and not required is left to its reader's
# default (`batch` 1, `engine` native).
FIELDS: dict[str, tuple[bool, str, Any]] = {
    "suite": (True, "a string", lambda v: isinstance(v, str)),
    "shape": (True, "a string", lambda v: isinstance(v, str)),
    "engine": (False, "a string", lambda v: isinstance(v, str)),
    "checkpoint": (False, "a string or null", lambda v: v is None or isinstance(v, str)),
    "num_speculative_tokens": (
        True,
        f"null or a whole number from 1 to {MAX_DRAFT_TOKENS}",
        lambda v: v is None or _count(v, 1, MAX_DRAFT_TOKENS),
    ),
    "temperature": (True, "a finite number >= 0", lambda v: _number(v) and v >= 0),
    "batch": (False, f"a whole number from 1 to {MAX_BATCH}", lambda v: _count(v, 1, MAX_BATCH)),
    "steps": (True, "a whole number >= 0", lambda v: _count(v, 0, MAX_COUNT)),
    "speedup": (True, "a finite number above 0", lambda v: _number(v) and v > 0),
    "target_only_tokens_per_s": (False, "a finite number above 0", lambda v: _number(v) and v > 0),
    "acceptance_length": (False, "null or a finite number >= 1", lambda v: v is None or (_number(v) and v >= 1)),
    "acceptance_length_per_request_mean": (
        False,
        "null or a finite number >= 1",
        lambda v: v is None or (_number(v) and v >= 1),
    ),
    "per_position_acceptance": (
        True,
        f"a list of at most {MAX_DRAFT_TOKENS} rates from 0 to 1",
        lambda v: isinstance(v, list) and len(v) <= MAX_DRAFT_TOKENS and all(_number(x) and 0 <= x <= 1 for x in v),
    ),
    "seconds": (
        False,
        "an object of finite seconds >= 0",
        lambda v: isinstance(v, dict) and all(_number(x) and x >= 0 for x in v.values()),
    ),
}


def record_problem(record: Any) -> str | None:
    """What is wrong with one record for the readers of `export.k` and `doctor` (None: nothing)."""
    if not isinstance(record, dict):
        return "not an object"
    for field, (required, what, ok) in FIELDS.items():
        if field not in record:
            if required:
                return f"no `{field}`"
            continue
        if not ok(record[field]):
            return f"`{field}` must be {what} (it is {_shown(record[field])})"
    k, rates = record["num_speculative_tokens"], record["per_position_acceptance"]
    if k is not None and str(record["shape"]).startswith(("chain", "tree")) and len(rates) > k:
        return f"`per_position_acceptance` holds {len(rates)} rates for K={k}"
    if any(b > a for a, b in pairwise(rates)):
        return "`per_position_acceptance` rises with the position (a step accepting i + 1 drafts accepted i)"
    return None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def checked_records(path: Path, records: list[Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """(the records fit to compute with, one line per record skipped naming `path`, its index and field)."""
    kept, skipped = [], []
    for i, record in enumerate(records):
        problem = record_problem(record)
        if problem is None:
            kept.append(record)
        else:
            skipped.append(f"{path}: record {i}: {problem}")
    return kept, skipped
