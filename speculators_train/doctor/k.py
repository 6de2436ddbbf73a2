"""The K to serve at: the expected speedup per K from a verify run's measured acceptance and costs
(`export.k`), at batch 1 and at a batch the user names, against the K the export serves."""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

from speculators_train.doctor.report import Check
from speculators_train.export.k import (
    PAYS,
    StepCosts,
    best_k,
    engine_speedups,
    expected_speedups,
    measured,
    step_costs,
)
from speculators_train.target import Target


@torch.inference_mode()
def timed_pass(target: Target, batch: int, width: int, context: list[int], repeats: int = 3) -> float:
    """Seconds of the target's forward pass over `width` new tokens in each of `batch` rows, after a cache of
    `context` (the fastest of `repeats`, each on a fresh copy of the cache)."""
    ids = torch.tensor([context] * batch, device=target.model.device)
    cache = target.model(input_ids=ids, use_cache=True, logits_to_keep=1).past_key_values  # no batch x vocab logits
    new = ids[:, -width:]
    best = float("inf")
    for _ in range(repeats):
        fresh = copy.deepcopy(cache)
        start = time.perf_counter()
        target.model(input_ids=new, past_key_values=fresh, use_cache=True)
        best = min(best, time.perf_counter() - start)
    return best


def batch_costs(target: Target, record: dict[str, Any], batch: int, context: list[int]) -> StepCosts:
    """The record's step costs at `batch` rows. The target's one-token and K + 1-token passes are timed here at
    batch 1 and at `batch`, and each measured cost is scaled by its pass's ratio; drafting and the rest scale as the
    one-token pass does (a chain draft runs one token per row, as that pass does)."""
    k = record["num_speculative_tokens"]
    base = step_costs(record)
    one = timed_pass(target, batch, 1, context) / timed_pass(target, 1, 1, context)
    wide = timed_pass(target, batch, k + 1, context) / timed_pass(target, 1, k + 1, context)
    return StepCosts(base.one * one, base.verify * wide, base.draft * one, base.other * one)


def _table(speedups: dict[int, float]) -> str:
    return ", ".join(f"K={j}: {s:.2f}x" for j, s in speedups.items())


def check_k(
    record: dict[str, Any] | None, where: str, served: int | None, batch: tuple[int, StepCosts] | None = None
) -> Check:
    """The K the record's measurements recommend, against `served` (the export's K; None: the run's K)."""
    name = "K" if batch is None else f"K at batch {batch[0]}"
    if not measured(record):
        return Check(name, "skip", f"no verify run of this checkpoint with the loop's timings ({where})",
                     "run `speculators-train verify <recipe>` first")  # fmt: skip
    assert record is not None
    speedups = expected_speedups(record, batch[1] if batch else None)
    best = best_k(speedups)
    k = served if served in speedups else record["num_speculative_tokens"]
    what = "the export serves" if served in speedups else "the run drafted"
    detail = f"expected speedup from {record['suite']} at T={record['temperature']:g}: {_table(speedups)}; "
    detail += f"best K={best}, {what} K={k}"
    if best < k and speedups[best] > speedups[k] * PAYS:
        fix = f"serve at K={best}: re-export (`export` writes the measured best unless --force-k) or set "
        fix += f"num_speculative_tokens={best}; K={k} drafts past where acceptance pays"
        return Check(name, "warn", detail, fix)
    return Check(name, "pass", detail)


def check_sweep(records: list[dict[str, Any]]) -> Check:
    """The K the largest-K record predicts against the loop measured at every K on the same prompts (a
    brute-force sweep): within one step, or as fast as the measured best within the sweep's noise (3%)."""
    measured_speedups = {r["num_speculative_tokens"]: r["speedup"] for r in records}
    predicted = best_k(expected_speedups(records[-1]))
    fastest = max(measured_speedups, key=measured_speedups.__getitem__)
    detail = f"measured: {_table(measured_speedups)}; best K={fastest}, predicted K={predicted}"
    close = measured_speedups[predicted] >= 0.97 * measured_speedups[fastest]
    if abs(predicted - fastest) <= 1 or close:
        return Check("K against a sweep", "pass", detail)
    fix = "the costs moved between runs (a busy machine?): rerun the sweep on a quiet machine"
    return Check("K against a sweep", "warn", detail, fix)


def check_engine_k(records: list[dict[str, Any]], engine: str, where: str, served: int | None, batch: int = 1) -> Check:
    """The K `engine`'s own verify records at `batch` requests at once recommend (its measured speedups, the Ks
    between on its cost line) against `served`, the export's K."""
    name = f"K in {engine}" + (f" at batch {batch}" if batch > 1 else "")
    measured_at, expected = engine_speedups(records, engine, batch)
    if not expected:
        return Check(name, "skip", f"no greedy draft record in {engine}'s verify run at {where}")
    best = best_k(expected)
    k = served if served in expected else max(measured_at)
    detail = f"{engine} measured {_table(measured_at)}; "
    if expected.keys() != measured_at.keys():
        detail += f"with the Ks between on its cost line: {_table(expected)}; "
    detail += f"best K={best}, the export serves K={k}" if served in expected else f"best K={best}"
    if best != k and expected[best] > expected[k] * PAYS:
        fix = f"serve {engine} at K={best}: re-export (`export` writes {engine}'s measured best for a format it "
        fix += f"serves, unless --force-k) or set num_speculative_tokens={best}"
        return Check(name, "warn", detail, fix)
    return Check(name, "pass", detail)
