"""The supported-targets table of docs/targets.md, generated from the target matrix (tests/targets.py) and the
engines' own answers (`engines/<name>/serving.py`: vLLM's registry, llama.cpp's converter and sources): a change of
either that the page does not show fails here. `SPECULATORS_TRAIN_WRITE_README=1 pytest
tests/test_supported_targets.py` rewrites the table."""

from __future__ import annotations

import os

from speculators_train.architectures import recurrent_layers
from speculators_train.engines import serving
from speculators_train.engines.vllm.serving import vllm_facts
from speculators_train.families import FAMILIES, get
from tests.conftest import REPO
from tests.targets import MATRIX, config_of

START, END = "<!-- supported-targets:start -->", "<!-- supported-targets:end -->"


class Target:
    """A recipe's target section for an HF folder (no GGUF file)."""

    name_or_path = "/a/folder"
    gguf_file = None


def cell(config, family: str, notes: list[str]) -> str:
    """What runs a draft of `family` on a target with `config`: the verify loop, vLLM, llama.cpp; a refusal or an
    engine left out is a footnote."""

    def note(why: str) -> str:
        if why not in notes:
            notes.append(why)
        return f"[{notes.index(why) + 1}]"

    settings = get(family).settings(family=family)
    if problems := settings.target_problems(config):
        return "refused " + note(problems[0].split(": ", 1)[1])
    out = ["train, export"]
    chains = "chains only: a recurrent layer keeps one state, which a tree's branches cannot share"
    out.append(f"loop {note(chains)}" if recurrent_layers(config) else "loop")
    engines = []
    if settings.vllm_format is not None:
        engines.append("vllm")
    if any(f.draft_file for f in get(family).formats.values()):
        engines.append("llama.cpp")
    for engine in engines:
        answer = serving.serving(engine, Target(), config, settings)
        label = "vLLM" if engine == "vllm" else engine
        if answer.problems:
            out.append(f"no {label} {note(answer.problems[0])}")
        elif answer.here:
            out.append(f"{label} {note(answer.here[0])}")
        else:
            out.append(label)
    return ", ".join(out)


def table() -> str:
    vllm_facts([config_of(arch).architectures[0] for arch in MATRIX])  # one vLLM start for every row
    notes: list[str] = []
    head = ["target (what it stands for)", *(f"`{family}`" for family in FAMILIES)]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arch in MATRIX:
        config = config_of(arch)
        name = f"{arch.name}: {', '.join(arch.classes)}"
        rows.append("| " + " | ".join([name, *(cell(config, family, notes) for family in FAMILIES)]) + " |")
    footnotes = [f"[{i}] {why}" for i, why in enumerate(notes, start=1)]
    return "\n".join([*rows, "", *(f"{line}  " for line in footnotes)])


def test_the_readme_shows_the_table_the_matrix_and_the_engines_give():
    """Regenerated from the matrix's configs and the engines' answers (a vLLM start and llama.cpp's converter per
    architecture the first time on a machine; cached after)."""
    from speculators_train.engines.llamacpp.converter import ensure_converter

    ensure_converter()  # llama.cpp's converter and sources, from the archive its programs are built from
    readme = REPO / "docs" / "targets.md"
    text = readme.read_text()
    assert START in text and END in text
    before, rest = text.split(START, 1)
    _, after = rest.split(END, 1)
    fresh = f"{before}{START}\n{table()}\n{END}{after}"
    if os.environ.get("SPECULATORS_TRAIN_WRITE_README") == "1":
        readme.write_text(fresh)
    assert fresh == text, "the supported-targets table of docs/targets.md is stale: rerun with " + (
        "SPECULATORS_TRAIN_WRITE_README=1"
    )
