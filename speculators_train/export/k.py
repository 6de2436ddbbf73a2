"""The K to serve at, from a verify run's measured per-position acceptance and costs.

With r_i the measured rate of steps accepting at least i + 1 drafts (at the run's K), drafting k <= K gives
AL(k) = 1 + sum_{i<k} r_i tokens per step. A step costs a verify pass of k + 1 tokens and k drafted tokens:
the run measured the pass at K + 1 (spec verify seconds per step) and at 1 (target-only seconds per token), and
passes between are taken on the line through those two; drafting costs its measured seconds per drafted token.
Expected speedup(k) = AL(k) * t_1 / (t_verify(k + 1) + k * t_draft). Past the run's K nothing was measured.

An engine (vLLM, llama.cpp) reports totals, not a step's parts: there a step at K costs AL(K) / speedup(K)
target-only tokens, and the cost per K is the line through the measured Ks (with one K, through 1 at K = 0: a
step is at least a one-token pass). A K the engine measured counts as measured, the others as expected.

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


PHASES = ("spec_verify", "spec_draft", "spec_prefill", "spec_bookkeeping")


def measured(record: dict[str, Any] | None) -> bool:
    """Whether `record` is a loop record with the timings the formula needs (engines' records report totals): a
    verify pass that took time, so no K's step costs nothing (`export.records` has checked the fields' types)."""
    if not record or not record.get("steps") or "target_only_tokens_per_s" not in record:
        return False
    seconds = record.get("seconds", {})
    return all(p in seconds for p in PHASES) and seconds["spec_verify"] > 0


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


def engine_records(records: list[dict[str, Any]], engine: str, batch: int = 1) -> dict[int, list[dict[str, Any]]]:
    """{K: the greedy records of the draft at K in `engine` with `batch` requests at once, one per suite}, on the
    first target the run served (llama.cpp also runs an unquantized copy of a quantized target)."""
    out: dict[int, list[dict[str, Any]]] = {}
    ours = [r for r in records if r.get("engine") == engine and str(r.get("shape", "")).startswith("chain")]
    served = ours[0].get("target") if ours else None
    for r in ours:
        greedy = r.get("temperature") == 0 and r.get("batch", 1) == batch
        if greedy and r.get("num_speculative_tokens") and r.get("target") == served:
            out.setdefault(r["num_speculative_tokens"], []).append(r)
    return dict(sorted(out.items()))


def _pooled_rates(records: list[dict[str, Any]], k: int) -> list[float]:
    """Per-position acceptance over `records`' steps together."""
    steps = sum(r["steps"] for r in records) or 1
    padded = [list(r["per_position_acceptance"][:k]) + [0.0] * (k - len(r["per_position_acceptance"][:k]))
              for r in records]  # fmt: skip
    return [sum(p[i] * r["steps"] for p, r in zip(padded, records, strict=True)) / steps for i in range(k)]


def engine_speedups(
    records: list[dict[str, Any]], engine: str, batch: int = 1
) -> tuple[dict[int, float], dict[int, float]]:
    """({K: measured speedup}, {k: expected speedup, measured where measured}) for k = 1..the largest K measured
    in `engine` at `batch` (both empty where it has no greedy draft record)."""
    by_k = engine_records(records, engine, batch)
    if not by_k:
        return {}, {}
    measured_at = {k: sum(r["speedup"] for r in rs) / len(rs) for k, rs in by_k.items()}
    # a step's cost in target-only tokens: tokens per step over speedup
    cost = {k: (1 + sum(_pooled_rates(rs, k))) / measured_at[k] for k, rs in by_k.items()}
    ks = list(cost)
    if len(ks) == 1:
        a, b = 1.0, max(cost[ks[0]] - 1.0, 0.0) / ks[0]
    else:
        mean_k, mean_c = sum(ks) / len(ks), sum(cost.values()) / len(ks)
        b = sum((k - mean_k) * (cost[k] - mean_c) for k in ks) / sum((k - mean_k) ** 2 for k in ks)
        a = mean_c - b * mean_k
    top = ks[-1]
    rates = _pooled_rates(by_k[top], top)
    expected = {j: measured_at.get(j, (1 + sum(rates[:j])) / max(a + b * j, 1e-9)) for j in range(1, top + 1)}
    return measured_at, expected


def recommended_k(records: list[dict[str, Any]], k: int, engine: str = "native") -> tuple[int, dict[int, float]] | None:
    """(the K to serve, the expected speedups) from the greedy loop record measured at `k` (`engine` native) or
    from `engine`'s records at the Ks it measured (`eval.<engine>.speculative_tokens`, which may leave out `k`); None
    where there are none."""
    if engine == "native":
        record = loop_record(records, k)
        speedups = expected_speedups(record) if record else {}
        if k not in speedups:
            return None
    else:
        speedups = engine_speedups(records, engine)[1]
    return (best_k(speedups), speedups) if speedups else None


def served_k(
    report: tuple[Path, list[dict[str, Any]]] | None, k: int, force_k: bool, engine: str = "native"
) -> tuple[int, list[str]]:
    """(the K an export serves, notes): the measured best of the newest verify `report` on the checkpoint (made in
    `engine`), where it recommends another K than `k` (the recipe's), unless `force_k`. The loop's record only
    ever recommends a smaller K (nothing past its K was measured); an engine's may pick any K it ran."""
    found = recommended_k(report[1], k, engine) if report else None
    if report is None or found is None or found[0] == k:
        return k, []
    best, speedups = found
    run = "verify run" if engine == "native" else f"{engine} verify run"
    measured_at = f"the {run} at {report[0]} expects {speedups[best]:.2f}x at K={best}, "
    measured_at += f"{speedups[k]:.2f}x at K={k}" if k in speedups else f"K={k} was not run there"
    if force_k:
        return k, [f"K={k} kept (--force-k): {measured_at}"]
    return best, [f"K={best}, not eval.num_speculative_tokens={k}: {measured_at} (--force-k keeps K={k})"]
