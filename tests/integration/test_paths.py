"""Paths a careless operator or an attacker chooses: an export directory over the run it reads, paths that break
out of the printed commands' quoting, links planted in a run directory or a logs directory. Each is refused with
one line or skipped with a note; nothing is deleted, run or read outside what the user named."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest
import torch

from speculators_train import families
from speculators_train.cli import main
from speculators_train.head import load_head_weights
from speculators_train.training.checkpoint import save_checkpoint
from tests.conftest import SHAREGPT, make_recipe, start_of, tiny_config
from tests.faults import clean_error, run_cli


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, Path]:
    """(recipe, run directory): an EAGLE-3 checkpoint in train/checkpoints and a file standing for stored states."""
    root = tmp_path_factory.mktemp("paths")
    recipe = make_recipe(root, [{"name": "sharegpt", "path": SHAREGPT, "max_records": 8}])
    config, head = load_head_weights(tiny_config())
    family = families.get("eagle3")
    settings = family.settings(family="eagle3", draft_vocab_size=64)
    torch.manual_seed(0)
    draft = family.new_draft(settings, start_of(config, head, torch.ones(config.vocab_size), [2, 4, 5]))
    save_checkpoint(root / "run" / "train" / "checkpoints", 1, draft, None, {"step": 1}, keep_last=1)
    (root / "run" / "hidden_states").mkdir()
    (root / "run" / "hidden_states" / "manifest.json").write_text("{}")
    return recipe, root / "run"


def contents(directory: Path) -> list[str]:
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*"))


@pytest.mark.parametrize("where", ["run", "run-parent", "checkpoints", "inside-checkpoint", "hidden-states"])
def test_an_export_over_what_it_reads_is_refused_and_deletes_nothing(tmp_path, capsys, run, where):
    recipe, run_dir = run
    out = {
        "run": run_dir,
        "run-parent": run_dir.parent,
        "checkpoints": run_dir / "train" / "checkpoints",
        "inside-checkpoint": run_dir / "train" / "checkpoints" / "step-000001" / "export",
        "hidden-states": run_dir / "hidden_states",
    }[where]
    before = contents(run_dir)
    clean_error(["export", recipe, "--force", "--out", out], capsys, f"--out {out}", "which the export reads")
    assert contents(run_dir) == before


def test_force_replaces_a_previous_export_and_nothing_else(tmp_path, capsys, run):
    recipe, _ = run
    out = tmp_path / "export"
    assert run_cli(["export", recipe, "--out", out], capsys)[0] == 0
    code, err = run_cli(["export", recipe, "--force", "--out", out], capsys)
    assert code == 0, err
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("a user's own files")
    clean_error(["export", recipe, "--force", "--out", mine], capsys, "is not an export of this toolkit")
    assert (mine / "notes.txt").read_text() == "a user's own files"


def test_printed_commands_keep_a_hostile_path_one_argument(tmp_path, capsys, run):
    """Each printed line, pasted into a shell whose `vllm` only prints its arguments, runs nothing else and passes
    the export directory through unchanged."""
    recipe, _ = run
    out = tmp_path / "x'; touch PWNED; echo '$(touch PWNED2)`touch PWNED3`"
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(["export", str(recipe), "--out", str(out), "--set", "export.verifier=hub/id'; touch PWNED4; echo x"])
    assert done.value.code == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("vllm serve")]
    assert lines
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "vllm").write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    (stubs / "vllm").chmod(0o755)
    for line in lines:
        shown = subprocess.run(
            ["bash", "-c", line], cwd=tmp_path, env={**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}"},
            capture_output=True, text=True, check=True,
        ).stdout.splitlines()  # fmt: skip
        assert shown == shlex.split(line)[1:]
        assert str(out) in shown or "hub/id'; touch PWNED4; echo x" in shown
        config = shown[shown.index("--speculative-config") + 1] if "--speculative-config" in shown else None
        assert config is None or json.loads(config)["model"] == str(out)
    assert not any(tmp_path.glob("PWNED*"))
    readme = (out / "README.md").read_text()
    assert all(line in readme for line in lines)


def test_a_link_planted_in_a_run_directory_is_refused(tmp_path, capsys):
    recipe = make_recipe(tmp_path, [{"name": "sharegpt", "path": SHAREGPT, "max_records": 4}])
    outside = tmp_path / "outside.txt"
    (tmp_path / "run" / "train").mkdir(parents=True)
    (tmp_path / "run" / "train" / "metrics.jsonl").symlink_to(outside)  # dangling: train would create it
    clean_error(["train", recipe], capsys, "metrics.jsonl is a symbolic link", "remove it")
    assert not outside.exists()


def test_a_link_out_of_the_logs_directory_is_not_ingested(tmp_path, capsys):
    recipe = make_recipe(tmp_path, [{"name": "sharegpt", "path": SHAREGPT, "max_records": 4}])
    logs = tmp_path / "logs"
    logs.mkdir()
    secret = tmp_path / "elsewhere.jsonl"
    record = {"id": "x", "messages": [{"role": "user", "content": "private text"}], "response": "not for training"}
    secret.write_text(json.dumps(record) + "\n")
    (logs / "b.jsonl").symlink_to(secret)
    record = {"id": "r0", "messages": [{"role": "user", "content": "Sort a list?"}], "response": "Use sorted()."}
    (logs / "a.jsonl").write_text(json.dumps(record) + "\n")
    code, err = run_cli(["osd", recipe, "--ingest-only", "--logs", logs], capsys)
    text = " ".join(err.split())
    assert code == 0, err
    assert "ingested 1 new records" in text and "b.jsonl: a link to a file outside" in text, text
    stored = "".join(p.read_text() for p in (tmp_path / "run" / "osd").rglob("*") if p.is_file())
    assert "private text" not in stored and "Sort a list?" in stored


def test_an_empty_held_out_split_is_refused_at_data_not_first_at_train(tmp_path, capsys):
    """Two records at a 1% held-out fraction hold none out: `data` warns in one line naming the setting and
    `generate` refuses before any work, where before only `train` (after generate's work) refused the split."""
    recipe = make_recipe(
        tmp_path, [{"name": "s", "path": SHAREGPT, "max_records": 2}], data={"held_out_fraction": 0.01}
    )
    code, err = run_cli(["data", recipe], capsys)
    assert code == 0 and "warning:" in err and "data.held_out_fraction 0.01 holds out none of the 2 records" in err
    clean_error(["generate", recipe], capsys, "data.held_out_fraction 0.01 holds out none of the 2 records")
    assert not (tmp_path / "run" / "hidden_states" / "manifest.json").exists()


def test_a_relative_model_folder_is_read_beside_the_recipe_when_run_from_elsewhere(tmp_path, monkeypatch):
    """`target.name_or_path: models/tiny` in project/recipes/r.yaml: from project/ it is there already; from any
    other directory it is read beside the recipe (its folder, then its parent), as the recipe's files are."""
    from speculators_train.recipe import load_recipe
    from tests.targets import tiny_target

    project = tmp_path / "project"
    (project / "models").mkdir(parents=True)
    (project / "models" / "tiny").symlink_to(tiny_target())
    sources = [{"name": "s", "path": SHAREGPT, "max_records": 8}]
    recipe = make_recipe(project / "recipes", sources, target={"name_or_path": "models/tiny"})
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert load_recipe(recipe).target.name_or_path == str(project / "models" / "tiny")
    monkeypatch.chdir(project)
    assert load_recipe(recipe).target.name_or_path == "models/tiny"  # the working directory's, as before
    hub = make_recipe(tmp_path / "hub", sources, target={"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"})
    assert load_recipe(hub).target.name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"
