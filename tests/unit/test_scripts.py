"""The eval/ scripts answer bad input the way the CLI does: one line naming the problem, exit 2, no traceback."""

import runpy
import sys

import pytest

from tests.conftest import REPO


def run_script(name: str, argv: list[str], capsys, monkeypatch) -> tuple[int, str]:
    """Run eval/`name` as `python eval/name ARGV...` would, in this process (its imports are already loaded)."""
    path = REPO / "eval" / name
    monkeypatch.setattr(sys, "argv", [str(path), *argv])
    monkeypatch.chdir(REPO)
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(path), run_name="__main__")
    return done.value.code, capsys.readouterr().err


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
def test_a_bad_recipe_override_is_one_line_and_exit_2(script, option, message, capsys, monkeypatch):
    code, err = run_script(script, [option], capsys, monkeypatch)
    assert code == 2, err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("variant", "message"),
    [
        ("nfc;draft.norm_before_fcc=true", "draft.norm_before_fcc: unknown key (did you mean norm_before_fc?)"),
        ("a=b;draft.ttt_steps=2", "--variant 'a=b;draft.ttt_steps=2': start with a name"),
        ("ttt;draft.ttt_steps", "--set 'draft.ttt_steps': expected KEY=VALUE"),
    ],
)
def test_a_bad_quality_variant_is_one_line_and_exit_2(variant, message, capsys, monkeypatch):
    """Variants are checked before anything trains (the slice is not generated for a typo either)."""
    code, err = run_script("bench_quality.py", ["--variant", variant, "--steps", "1"], capsys, monkeypatch)
    assert code == 2, err
    assert message in err and "Traceback" not in err
