"""The test suite's time budget, read from pytest's own per-test durations (its JUnit XML: setup, call and teardown
of each test). The goals: the unit tier under 2 minutes, unit + integration (`make test-fast`) under 8, the default
run of all three tiers (`make test`, what CI runs) under 25; CI enforces `BUDGETS`, today's ceilings on the way
there. A tier set is judged only when every one of its tiers ran.

`python -m tests.budget FILE` prints the time per tier and the slowest tests, and exits 1 when a budget is passed on
the CI kind (`CI` set, as CI sets it): a slower laptop gets the same table as a warning. The full run
(SPECULATORS_TRAIN_FULL=1) has no budget.
"""

from __future__ import annotations

import os
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

TIERS = ("unit", "integration", "e2e")
# The goals, in seconds of tests, by the tiers a run holds (a run of more tiers is also judged on each smaller set).
GOALS: dict[tuple[str, ...], float] = {
    ("unit",): 120.0,
    ("unit", "integration"): 480.0,
    ("unit", "integration", "e2e"): 1500.0,
}
# What CI enforces until the suite reaches its goals: the default run on the CI kind with room for a machine without
# AVX-512 (up to half as fast on these kernels).
# Lower each toward its goal as tests get cheaper; never raise one to make room for a new test.
BUDGETS: dict[tuple[str, ...], float] = {
    ("unit",): 180.0,
    ("unit", "integration"): 1300.0,
    ("unit", "integration", "e2e"): 2400.0,
}


def durations(junit: Path) -> dict[str, float]:
    """Seconds per test id (`tests/<tier>/...::name`) from pytest's JUnit XML."""
    out: dict[str, float] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        out[f"{module}.py::{case.get('name', '')}"] = float(case.get("time") or 0.0)
    return out


def tier_of(test_id: str) -> str | None:
    parts = test_id.split("/")
    return parts[1] if len(parts) > 2 and parts[0] == "tests" and parts[1] in TIERS else None


def judge(times: dict[str, float]) -> tuple[dict[str, float], list[str]]:
    """(seconds per tier, one line per budget passed)."""
    per_tier: dict[str, float] = defaultdict(float)
    for test, seconds in times.items():
        tier = tier_of(test)
        if tier is not None:
            per_tier[tier] += seconds
    over = []
    for tiers, budget in BUDGETS.items():
        if all(t in per_tier for t in tiers):
            spent = sum(per_tier[t] for t in tiers)
            if spent > budget:
                over.append(f"{' + '.join(tiers)}: {spent:.0f} s of tests, over the budget of {budget:.0f} s")
    return dict(per_tier), over


def main(argv: list[str]) -> int:
    times = durations(Path(argv[0]))
    per_tier, over = judge(times)
    print("tests' time by tier: " + ", ".join(f"{t} {per_tier[t]:.0f} s" for t in TIERS if t in per_tier))
    goals = [f"{' + '.join(t)} {GOALS[t]:.0f} s" for t in GOALS if all(x in per_tier for x in t)]
    print(f"total {sum(per_tier.values()):.0f} s (goals: {', '.join(goals)}); slowest:")
    for test, seconds in sorted(times.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {seconds:7.1f} s  {test}")
    if os.environ.get("SPECULATORS_TRAIN_FULL") == "1" or not over:
        return 0
    for line in over:
        print(f"over budget: {line}", file=sys.stderr)
    if os.environ.get("CI"):
        print("move a proof behind SPECULATORS_TRAIN_FULL=1 or make it cheaper (README, Tests)", file=sys.stderr)
        return 1
    print("(enforced on the CI kind only: CI is not set here)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
