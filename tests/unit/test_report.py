"""Scores of a verify run, on hand-made generations: acceptance as vLLM counts it, and speedup paired per prompt."""

import pytest

from speculators_train.verify.decoder import Generation
from speculators_train.verify.report import acceptance, markdown, score, speedup_cell


def test_acceptance_length_counts_the_target_token_and_positions_count_steps_accepted_that_far():
    out = acceptance([0, 3, 1, 2], k=3)
    assert out["acceptance_length"] == pytest.approx(1 + 6 / 4)
    assert out["per_position_acceptance"] == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    assert out["acceptance_length"] == pytest.approx(1 + sum(out["per_position_acceptance"]))
    assert out["draft_acceptance_rate"] == pytest.approx(6 / 12)
    assert acceptance([], k=3)["acceptance_length"] is None


def test_speedup_is_overall_tokens_per_second_and_its_spread_pairs_each_prompt_with_its_own_baseline():
    """Prompt 0 ran in a slow spell (baseline and speculative run alike 2x slower): paired, both prompts show
    1.5x; the overall figure weighs prompts by time, and the quartiles must not mix prompt 0's speculative run
    with prompt 1's baseline."""
    baseline = [Generation(tokens=[1] * 30, seconds=6.0), Generation(tokens=[1] * 30, seconds=3.0)]
    speculative = [
        Generation(tokens=[1] * 30, accepted=[1, 0], seconds=4.0),
        Generation(tokens=[1] * 30, accepted=[2, 1], seconds=2.0),
    ]
    record = score("suite", "chain(K=2)", 2, 0.0, 1.0, speculative, baseline)
    assert record["speedup"] == pytest.approx((60 / 6) / (60 / 9))
    assert record["per_prompt_speedup_quartiles"] == pytest.approx([1.5, 1.5, 1.5])
    assert record["greedy_identical_outputs"] == "2/2"
    speculative[1].seconds = 1.0  # prompt 1 now 3x
    record = score("suite", "chain(K=2)", 2, 0.0, 1.0, speculative, baseline)
    assert record["per_prompt_speedup_quartiles"] == pytest.approx([1.875, 2.25, 2.625])
    assert speedup_cell(record) == f"{record['speedup']:.2f}x (1.88-2.62)"
    assert "(1.88-2.62)" in markdown([record])


def test_both_als_are_reported_and_differ_when_requests_accept_unevenly():
    """Pooled over steps (vLLM, SGLang): a long request that accepts little weighs more; the per-request mean
    (SpecForge) weighs each request once. One request of 4 steps accepting nothing and one of 1 step accepting 2:
    pooled 1 + 2/5 = 1.4, per-request mean (1 + 3) / 2 = 2.0."""
    baseline = [Generation(tokens=[1] * 4, seconds=1.0), Generation(tokens=[1] * 3, seconds=1.0)]
    speculative = [
        Generation(tokens=[1] * 4, accepted=[0, 0, 0, 0], seconds=1.0),
        Generation(tokens=[1] * 3, accepted=[2], seconds=1.0),
    ]
    record = score("suite", "chain(K=2)", 2, 0.0, 1.0, speculative, baseline)
    assert record["acceptance_length"] == pytest.approx(1.4)
    assert record["acceptance_length_per_request_mean"] == pytest.approx(2.0)
    row = markdown([record]).splitlines()[2]
    assert "| 1.40 | 2.00 |" in row
