"""The K a verify run's measurements recommend (`doctor`): acceptance per position against the costs measured."""

import pytest

from speculators_train.doctor.k import check_k, expected_speedups


def record(rates, k=4, verify=0.05, draft=0.01, steps=100) -> dict:
    """A loop record at K = `k`: a one-token pass of 0.04 s, a K + 1 pass of `verify` s, `draft` s per drafted
    token, no other cost."""
    return {
        "suite": "s",
        "temperature": 0.0,
        "num_speculative_tokens": k,
        "steps": steps,
        "per_position_acceptance": rates,
        "target_only_tokens_per_s": 25.0,
        "seconds": {"spec_verify": verify * steps, "spec_draft": draft * k * steps, "spec_prefill": 0.0,
                    "spec_bookkeeping": 0.0},
    }  # fmt: skip


def test_expected_speedup_is_acceptance_length_over_the_measured_step_cost():
    out = expected_speedups(record([0.8, 0.5, 0.1, 0.05]))
    # K = 4: AL 2.45, a step 0.05 + 4 * 0.01 = 0.09 s against 0.04 s a token
    assert out[4] == pytest.approx(2.45 * 0.04 / 0.09)
    # K = 2: AL 2.3, the pass on the line from 0.04 (1 token) to 0.05 (5 tokens): 0.045, plus 0.02 of drafting
    assert out[2] == pytest.approx(2.3 * 0.04 / (0.045 + 0.02))


def test_a_k_past_where_acceptance_pays_is_a_warning_naming_the_best():
    check = check_k(record([0.8, 0.5, 0.1, 0.05]), "runs/x/verify")
    assert check.status == "warn" and "serve at K=2" in check.fix
    assert check_k(record([0.9, 0.9, 0.9, 0.9]), "runs/x/verify").status == "pass"
    assert check_k(None, "runs/x/verify").status == "skip"


def test_a_loop_far_below_trainings_prediction_is_a_warning_with_its_causes():
    from speculators_train.doctor.acceptance import check_exposure

    loop = {**record([0.5, 0.2, 0.1, 0.0]), "acceptance_length": 1.8}
    assert check_exposure(loop, {"predicted_al_4": 2.9}).status == "warn"  # 0.8 of 1.9 accepted predicted
    assert check_exposure(loop, {"predicted_al_4": 1.9}).status == "pass"
    assert check_exposure(loop, {"predicted_al_3": 1.9}).status == "skip"  # no prediction at the run's K
