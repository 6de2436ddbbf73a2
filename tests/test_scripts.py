"""The eval/ scripts answer bad input the way the CLI does: one line naming the problem, exit 2, no traceback."""

import subprocess
import sys

import pytest

from .conftest import REPO


@pytest.mark.parametrize("script", ["bench_generate.py", "bench_train.py", "bench_verify.py", "osd_drift.py"])
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
