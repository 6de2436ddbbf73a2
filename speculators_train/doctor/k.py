"""The K to serve at, from a verify run's measured per-position acceptance and costs.

With r_i the measured rate of steps accepting at least i + 1 drafts (at the run's K), drafting k <= K gives
AL(k) = 1 + sum_{i<k} r_i tokens per step. A step costs a verify pass of k + 1 tokens and k drafted tokens:
the run measured the pass at K + 1 (spec verify seconds per step) and at 1 (target-only seconds per token), and
passes between are taken on the line through those two; drafting costs its measured seconds per drafted token.
Expected speedup(k) = AL(k) * t_1 / (t_verify(k + 1) + k * t_draft). Past the run's K nothing was measured."""

from __future__ import annotations

from typing import Any

from speculators_train.doctor.report import Check


def expected_speedups(record: dict[str, Any]) -> dict[int, float]:
    k, steps, rates = record["num_speculative_tokens"], record["steps"], record["per_position_acceptance"]
    seconds = record["seconds"]
    one = 1 / record["target_only_tokens_per_s"]  # a one-token pass, as target-only decoding runs it
    verify = seconds["spec_verify"] / steps
    draft = seconds["spec_draft"] / (steps * k)
    other = (seconds["spec_prefill"] + seconds["spec_bookkeeping"]) / steps
    out = {}
    for j in range(1, k + 1):
        cost = one + (verify - one) * j / k + j * draft + other
        out[j] = (1 + sum(rates[:j])) * one / cost
    return out


def check_k(record: dict[str, Any] | None, where: str) -> Check:
    if record is None or not record.get("steps") or "spec_verify" not in record.get("seconds", {}):
        return Check("K", "skip", f"no verify run of this checkpoint with the loop's timings ({where})",
                     "run `speculators-train verify <recipe>` first")  # fmt: skip
    k = record["num_speculative_tokens"]
    speedups = expected_speedups(record)
    best = max(speedups, key=speedups.__getitem__)
    table = ", ".join(f"K={j}: {s:.2f}x" for j, s in speedups.items())
    detail = f"expected speedup from {record['suite']} at T={record['temperature']:g}: {table}"
    if best < k and speedups[best] > speedups[k] * 1.02:
        fix = f"serve at K={best} (eval.num_speculative_tokens): K={k} drafts past where acceptance pays"
        return Check("K", "warn", detail, fix)
    return Check("K", "pass", f"{detail}; K={k} is the best measured")
