"""The learning curve from the trainer's metrics log: its points, and whether more training would still pay."""

import json

from speculators_train.doctor.curve import check_curve, curve_points


def log(tmp_path, rows, tail=""):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0}) for s, _ in rows]  # train records carry no val keys
    lines += [json.dumps({"step": s, "val/predicted_al_5": a}) for s, a in rows]
    path.write_text("\n".join(lines) + "\n" + tail)
    return path


def test_points_are_the_validations_the_last_of_a_step_winning_and_a_cut_line_left_out(tmp_path):
    path = log(tmp_path, [(20, 1.1), (40, 1.2), (40, 1.25)], tail='{"step": 60, "val/predicted_al_5"')
    assert curve_points(path, 5) == [(20, 1.1), (40, 1.25)]
    assert curve_points(path, 3) == []  # no prediction at another K
    assert curve_points(tmp_path / "missing.jsonl", 5) == []


def test_a_curve_still_rising_per_doubling_is_a_warning_with_what_more_training_buys():
    rising = check_curve([(10, 1.05), (20, 1.10), (40, 1.18), (80, 1.26)], 5, "m")
    assert rising.status == "warn" and "+0.08 per doubling of the steps since step 40" in rising.detail
    assert "about +0.08 AL per doubling" in rising.fix
    flat = check_curve([(10, 1.05), (20, 1.20), (40, 1.21), (80, 1.215)], 5, "m")
    assert flat.status == "pass" and "+0.01 per doubling" in flat.detail
    assert check_curve([(86, 1.2)], 5, "m").status == "skip"
