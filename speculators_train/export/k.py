"""The K to serve at, from a verify run's measured per-position acceptance and costs.

With r_i the measured rate of steps accepting at least i + 1 drafts (at the run's K), drafting k <= K gives
AL(k) = 1 + sum_{i<k} r_i tokens per step. A step costs a verify pass of k + 1 tokens and k drafted tokens:
the run measured the pass at K + 1 (spec verify seconds per step) and at 1 (target-only seconds per token), and
passes between are taken on the line through those two; drafting costs its measured seconds per drafted token.
Expected speedup(k) = AL(k) * t_1 / (t_verify(k + 1) + k * t_draft). Past the run's K nothing was measured.

`export` writes the recommended K into the export and its serve lines (unless `--force-k`), `doctor` reports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

PAYS = 1.02  # a smaller K is recommended only when it is expected to be at least this much faster


@dataclass(frozen=True)
class StepCosts:
    """Seconds of one decoding step's parts: a one-token target pass, a K + 1 pass, one drafted token, the rest."""

    one: float
    verify: float
    draft: float
    other: float


def measured(record: dict[str, Any] | None) -> bool:
    """Whether `record` is a loop record with the timings the formula needs (engines' records report totals)."""
    return bool(record and record.get("steps") and "spec_verify" in record.get("seconds", {}))


def step_costs(record: dict[str, Any]) -> StepCosts:
    k, steps, seconds = record["num_speculative_tokens"], record["steps"], record["seconds"]
    return StepCosts(
        one=1 / record["target_only_tokens_per_s"],  # a one-token pass, as target-only decoding runs it
        verify=seconds["spec_verify"] / steps,
        draft=seconds["spec_draft"] / (steps * k),
        other=(seconds["spec_prefill"] + seconds["spec_bookkeeping"]) / steps,
    )


def expected_speedups(record: dict[str, Any], costs: StepCosts | None = None) -> dict[int, float]:
    """Expected speedup at k = 1..record's K, from its acceptance and `costs` (default: the record's own)."""
    k, rates = record["num_speculative_tokens"], record["per_position_acceptance"]
    c = costs or step_costs(record)
    out = {}
    for j in range(1, k + 1):
        cost = c.one + (c.verify - c.one) * j / k + j * c.draft + c.other
        out[j] = (1 + sum(rates[:j])) * c.one / cost
    return out


def best_k(speedups: dict[int, float]) -> int:
    """The largest K unless a smaller one is expected to pay at least `PAYS` times more."""
    k = max(speedups)
    best = max(speedups, key=speedups.__getitem__)
    return best if speedups[best] > speedups[k] * PAYS else k


def loop_record(records: list[dict[str, Any]], k: int | None = None) -> dict[str, Any] | None:
    """The first greedy chain record of the native loop with its timings (at K = `k`, when given), or None."""
    for r in records:
        if r.get("engine", "native") != "native" or r.get("temperature") != 0 or not measured(r):
            continue
        if str(r.get("shape", "")).startswith("chain") and k in (None, r["num_speculative_tokens"]):
            return r
    return None


def recommended_k(records: list[dict[str, Any]], k: int) -> tuple[int, dict[int, float], dict[str, Any]] | None:
    """(the K to serve, the expected speedups, the record) from the first greedy loop record measured at `k`, or
    None where there is none."""
    record = loop_record(records, k)
    if record is None:
        return None
    speedups = expected_speedups(record)
    return best_k(speedups), speedups, record


def served_k(report: tuple[Path, list[dict[str, Any]]] | None, k: int, force_k: bool) -> tuple[int, list[str]]:
    """(the K an export serves, notes): the measured best of the newest verify `report` on the checkpoint, where
    one recommends a smaller K than `k` (the recipe's), unless `force_k`."""
    found = recommended_k(report[1], k) if report else None
    if report is None or found is None or found[0] == k:
        return k, []
    best, speedups, _ = found
    measured_at = f"the verify run at {report[0]} expects {speedups[best]:.2f}x at K={best}, "
    measured_at += f"{speedups[k]:.2f}x at K={k}"
    if force_k:
        return k, [f"K={k} kept (--force-k): {measured_at}"]
    return best, [f"K={best}, not eval.num_speculative_tokens={k}: {measured_at} (--force-k keeps K={k})"]
