"""The K a verify run's measurements recommend (`doctor`): acceptance per position against the costs measured."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from speculators_train.doctor.acceptance import check_engine_baselines
from speculators_train.doctor.k import check_engine_k, check_k, check_sweep
from speculators_train.export.k import StepCosts, engine_speedups, expected_speedups, served_k
from speculators_train.export.run import latest_verify_report
from speculators_train.families.format_common import proposal_config, proposal_k


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
        "speedup": 1.0,
        "shape": f"chain(K={k})",
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
    check = check_k(record([0.8, 0.5, 0.1, 0.05]), "runs/x/verify", None)
    assert check.status == "warn" and "serve at K=2" in check.fix and "the run drafted K=4" in check.detail
    assert check_k(record([0.9, 0.9, 0.9, 0.9]), "runs/x/verify", None).status == "pass"
    assert check_k(None, "runs/x/verify", None).status == "skip"


def test_the_check_judges_the_k_the_export_serves():
    low = record([0.8, 0.5, 0.1, 0.05])
    assert check_k(low, "v", 2).status == "pass"  # an export already at the measured best
    check = check_k(low, "v", 3)
    assert check.status == "warn" and "the export serves K=3" in check.detail


def test_a_batch_makes_the_wide_pass_costlier_and_moves_the_best_k_down():
    high = record([0.8, 0.6, 0.4, 0.3], draft=0.002)
    assert "best K=4" in check_k(high, "v", None).detail
    # at a batch where the 5-token pass costs 5 one-token passes (compute-bound), drafting more stops paying
    batched = StepCosts(one=0.04, verify=0.2, draft=0.002, other=0.0)
    check = check_k(high, "v", None, (16, batched))
    assert check.name == "K at batch 16" and check.status == "warn" and "serve at K=1" in check.fix


def test_export_writes_the_measured_best_k_unless_forced():
    report = (Path("runs/x/verify/1/results.json"), [record([0.8, 0.5, 0.1, 0.05])])
    k, notes = served_k(report, 4, force_k=False)
    assert k == 2 and "K=2, not eval.num_speculative_tokens=4" in notes[0] and "runs/x/verify/1" in notes[0]
    k, notes = served_k(report, 4, force_k=True)
    assert k == 4 and notes[0].startswith("K=4 kept (--force-k)")
    assert served_k(report, 3, force_k=False) == (3, [])  # measured at another K: nothing to say about K=3
    assert served_k(None, 4, force_k=False) == (4, [])
    sampled = (report[0], [{**report[1][0], "temperature": 1.0}])
    assert served_k(sampled, 4, force_k=False) == (4, [])  # only a greedy loop record decides


def test_the_served_k_is_read_back_from_the_speculators_config():
    assert proposal_k({"speculators_config": proposal_config("eagle3", 3, "v", ["A"])}) == 3
    assert proposal_k({"speculators_config": {"proposal_methods": []}}) is None
    assert proposal_k({"draft_vocab_size": 3}) is None


def test_a_sweep_agrees_within_one_step_or_within_its_noise():
    measured = [(1, 1.30), (2, 1.42), (3, 1.40), (4, 1.36)]
    sweep = [{**record([0.8, 0.5, 0.1, 0.05][:k], k=k), "speedup": s} for k, s in measured]
    assert check_sweep(sweep).status == "pass"  # predicted K=2 (above), measured best K=2
    far = [{**r, "speedup": s} for r, s in zip(sweep, [1.0, 1.1, 1.2, 1.5], strict=True)]
    check = check_sweep(far)
    assert check.status == "warn" and "best K=4, predicted K=2" in check.detail


def test_a_loop_far_below_trainings_prediction_is_a_warning_with_its_causes():
    from speculators_train.doctor.acceptance import check_exposure

    loop = {**record([0.5, 0.2, 0.1, 0.0]), "acceptance_length": 1.8}
    assert check_exposure(loop, {"predicted_al_4": 2.9}).status == "warn"  # 0.8 of 1.9 accepted predicted
    assert check_exposure(loop, {"predicted_al_4": 1.9}).status == "pass"
    assert check_exposure(loop, {"predicted_al_3": 1.9}).status == "skip"  # no prediction at the run's K


def test_acceptance_by_suite_names_a_suite_far_below_the_best():
    from speculators_train.doctor.acceptance import check_suites

    def suite(name, al, shape="chain(K=4)"):
        return {**record([0.5, 0.2, 0.1, 0.0]), "suite": name, "acceptance_length": al, "speedup": 1.0, "shape": shape}

    check = check_suites([suite("chat", 1.8), suite("code", 1.3), suite("code", 2.5, "ngram(K=4)")])
    assert check.status == "warn" and check.fix.startswith("code:")  # 0.3 accepted per step against 0.8
    assert "chat AL 1.80 pooled, 1.80 per-request mean, 1.00x" in check.detail and "2.50" not in check.detail
    assert check_suites([suite("chat", 1.8), suite("code", 1.5)]).status == "pass"
    assert check_suites([]).status == "skip"


def engine_record(k: int, rates: list[float], speedup: float, engine: str = "vllm", suite: str = "s") -> dict:
    return {"engine": engine, "suite": suite, "shape": f"chain(K={k})", "num_speculative_tokens": k, "batch": 1,
            "temperature": 0.0, "steps": 100, "per_position_acceptance": rates, "speedup": speedup,
            "acceptance_length": 1 + sum(rates), "checkpoint": "ckpt"}  # fmt: skip


RATES = [0.8, 0.5, 0.1, 0.05]


def test_an_engines_step_cost_is_the_line_through_its_measured_ks():
    # a step costs 1 + K/4 target-only tokens: K=4 -> 2.0 (AL 2.45, 1.225x), K=2 -> 1.5 (AL 2.3, 1.533x)
    records = [engine_record(2, RATES[:2], 2.3 / 1.5), engine_record(4, RATES, 2.45 / 2.0)]
    measured_at, expected = engine_speedups(records, "vllm")
    assert measured_at == {2: pytest.approx(2.3 / 1.5), 4: pytest.approx(1.225)}
    assert expected[1] == pytest.approx(1.8 / 1.25) and expected[3] == pytest.approx(2.4 / 1.75)
    assert engine_speedups(records, "llama.cpp") == ({}, {})  # another engine's records say nothing here
    unquantized = {**engine_record(4, RATES, 3.0), "target": "f32"}  # llama.cpp's second target is not the served one
    assert engine_speedups([{**r, "target": "gguf"} for r in records] + [unquantized], "vllm")[0] == measured_at
    batched = {**engine_record(4, RATES, 0.9), "batch": 8}  # all prompts at once: its own K, not batch 1's
    assert engine_speedups([*records, batched], "vllm")[0] == measured_at
    assert engine_speedups([*records, batched], "vllm", batch=8)[0] == {4: 0.9}
    assert check_engine_k([*records, batched], "vllm", "v", 4, batch=8).name == "K in vllm at batch 8"
    # one measured K: the line runs through a one-token pass at K = 0
    _, single = engine_speedups(records[1:], "vllm")
    assert single[2] == pytest.approx(2.3 / 1.5)
    check = check_engine_k(records, "vllm", "runs/x/verify/2", 4)
    assert check.status == "warn" and "serve vllm at K=2" in check.fix and "the export serves K=4" in check.detail


def test_export_takes_the_serving_engines_measured_k():
    report = (Path("runs/x/verify/2/results.json"), [engine_record(2, RATES[:2], 2.3 / 1.5),
                                                    engine_record(4, RATES, 1.225)])  # fmt: skip
    k, notes = served_k(report, 4, force_k=False, engine="vllm")
    assert k == 2 and "the vllm verify run at runs/x/verify/2" in notes[0]
    assert served_k(report, 4, force_k=False) == (4, [])  # no native loop record in an engine's run
    k, notes = served_k(report, 6, force_k=False, engine="vllm")  # the engine ran other Ks than the recipe's
    assert k == 2 and "K=6 was not run there" in notes[0]


def test_the_draft_is_compared_with_the_engines_own_draftless_methods():
    draft = engine_record(2, RATES[:2], 1.3, engine="llama.cpp")
    free = {**draft, "shape": "ngram-simple", "num_speculative_tokens": None, "speedup": 1.4, "checkpoint": None}
    check = check_engine_baselines([draft, free], "llama.cpp")
    assert check.status == "warn" and "ngram-simple 1.40x" in check.detail and "on s " in check.fix
    assert check_engine_baselines([draft, {**free, "speedup": 1.1}], "llama.cpp").status == "pass"
    assert check_engine_baselines([draft], "llama.cpp").status == "skip"


def test_the_newest_report_per_engine_counts_an_engines_draftless_records(tmp_path):
    ckpt = tmp_path / "ckpt"
    runs = {"1": [{**record(RATES), "checkpoint": str(ckpt)}],
            "2": [{**engine_record(4, RATES, 1.2), "checkpoint": str(ckpt)},
                  {**engine_record(4, RATES, 1.1), "shape": "ngram(K=4)", "checkpoint": None}],
            "3": [{**record(RATES), "checkpoint": str(tmp_path / "another")}]}  # fmt: skip
    for name, records in runs.items():
        (tmp_path / "verify" / name).mkdir(parents=True)
        (tmp_path / "verify" / name / "results.json").write_text(json.dumps(records))
    recipe = SimpleNamespace(run_dir=tmp_path)
    assert latest_verify_report(recipe, ckpt)[0].parent.name == "1"  # type: ignore[arg-type,index]
    assert latest_verify_report(recipe, ckpt, "vllm")[0].parent.name == "2"  # type: ignore[arg-type,index]
    assert latest_verify_report(recipe, ckpt, "llama.cpp") is None  # type: ignore[arg-type]


def test_the_served_engines_own_k_check_decides_and_the_loops_stands_as_information():
    from speculators_train.doctor.report import Check
    from speculators_train.doctor.run import defer_to_engine

    loop = [Check("K", "warn", "best K=1", "serve at K=1"), Check("K against a sweep", "warn", "x", "rerun")]
    vllm = [Check("K in vllm", "pass", "best K=3")]
    out = defer_to_engine(loop, vllm, "vllm")
    assert out[0].status == "pass" and "its own run decides (K in vllm)" in out[0].detail and out[0].fix == ""
    assert out[1].status == "warn" and out[2:] == vllm  # the sweep is the loop's own question
    assert defer_to_engine(loop, vllm, "llama.cpp") == loop + vllm  # llama.cpp measured nothing: the loop decides
    assert defer_to_engine(loop, [Check("K in vllm", "skip", "no run")], "vllm")[0].status == "warn"
