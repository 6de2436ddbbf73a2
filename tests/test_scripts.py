"""The eval/ scripts answer bad input the way the CLI does: one line naming the problem, exit 2, no traceback."""

import subprocess
import sys

import pytest

from .conftest import REPO


@pytest.mark.parametrize(
    "script", ["bench_generate.py", "bench_train.py", "bench_verify.py", "bench_regenerate.py", "osd_drift.py"]
)
@pytest.mark.parametrize(
    ("option", "message"),
    [
        ("--set=data.max_lenght=5", "data.max_lenght: unknown key (did you mean max_length?)"),
        ("--set=oops", "--set 'oops': expected KEY=VALUE"),
    ],
)
def test_a_bad_recipe_override_is_one_line_and_exit_2(script, option, message):
    done = subprocess.run(
        [sys.executable, str(REPO / "eval" / script), option], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("variant", "message"),
    [
        ("nfc;draft.norm_before_fcc=true", "draft.norm_before_fcc: unknown key (did you mean norm_before_fc?)"),
        ("a=b;draft.ttt_steps=2", "--variant 'a=b;draft.ttt_steps=2': start with a name"),
        ("ttt;draft.ttt_steps", "--set 'draft.ttt_steps': expected KEY=VALUE"),
    ],
)
def test_a_bad_quality_variant_is_one_line_and_exit_2(variant, message, tmp_path):
    """Variants are checked before anything trains (the slice is not generated for a typo either)."""
    done = subprocess.run(
        [sys.executable, str(REPO / "eval" / "bench_quality.py"), "--variant", variant, "--steps", "1"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr
