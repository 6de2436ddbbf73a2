"""The suite's time budget (tests/budget.py), read from a JUnit file as pytest writes it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import budget


def junit(tmp_path: Path, cases: dict[str, float]) -> Path:
    rows = "".join(
        f'<testcase classname="{module}" name="{name}" time="{seconds}" />'
        for (module, name), seconds in ((key.split("::"), value) for key, value in cases.items())
    )
    path = tmp_path / "junit.xml"
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{rows}</testsuite></testsuites>')
    return path


def test_time_is_summed_per_tier_including_parametrized_cases(tmp_path):
    times = budget.durations(
        junit(tmp_path, {"tests.unit.test_a::test_x[1]": 1.5, "tests.unit.test_a::test_x[2]": 2.0, "tests.e2e.t::y": 3})
    )
    per_tier, over = budget.judge(times)
    assert per_tier == {"unit": 3.5, "e2e": 3.0} and over == []


@pytest.mark.parametrize(
    ("cases", "passed"),
    [
        ({"tests.unit.a::t": 181}, ["unit"]),
        ({"tests.unit.a::t": 100, "tests.integration.b::t": 1201}, ["unit + integration"]),
        ({"tests.unit.a::t": 99, "tests.integration.b::t": 1100, "tests.e2e.c::t": 1202}, ["unit + integration + e2e"]),
        # the e2e tier alone has no budget of its own: only runs that hold every tier of a set are judged
        ({"tests.e2e.c::t": 3000}, []),
        ({"tests.unit.a::t": 119, "tests.integration.b::t": 300, "tests.e2e.c::t": 1000}, []),
    ],
)
def test_each_budget_is_judged_on_the_tiers_it_names(tmp_path, cases, passed):
    _, over = budget.judge(budget.durations(junit(tmp_path, cases)))
    assert [line.split(":")[0] for line in over] == passed


def test_over_budget_fails_on_the_ci_kind_and_warns_elsewhere(tmp_path, monkeypatch, capsys):
    path = junit(tmp_path, {"tests.unit.a::t": 500})
    monkeypatch.delenv("SPECULATORS_TRAIN_FULL", raising=False)
    monkeypatch.setenv("CI", "true")
    assert budget.main([str(path)]) == 1
    assert "unit: 500 s of tests, over the budget of 180 s" in capsys.readouterr().err
    monkeypatch.delenv("CI")
    assert budget.main([str(path)]) == 0
    monkeypatch.setenv("CI", "true")
    monkeypatch.setenv("SPECULATORS_TRAIN_FULL", "1")
    assert budget.main([str(path)]) == 0
