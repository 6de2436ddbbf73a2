"""The engine registry (`speculators_train/engines/`): every engine keeps the whole contract of `engines/base.py`, and
every place that lists or picks an engine reads the registry, so a new engine is its folder plus the places
docs/architecture.md names, and no stage dispatches on an engine's name."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import types
from importlib import import_module
from pathlib import Path
from types import SimpleNamespace
from typing import Any, get_args

import pytest

from speculators_train import engines
from speculators_train.engines.base import Engine
from speculators_train.engines.serving import Serving, served_commands, serving
from speculators_train.eval_config import EvalConfig
from speculators_train.families import FAMILIES, get
from tests.conftest import REPO

PACKAGE = REPO / "speculators_train"


def sections() -> dict[str, type]:
    """{engine folder: the type of its `eval.<section>`}: the EvalConfig fields whose type an engine folder defines."""
    out = {}
    for field in EvalConfig.model_fields.values():
        module = getattr(field.annotation, "__module__", "")
        if module.startswith("speculators_train.engines."):
            out[module.split(".")[2]] = field.annotation
    return out


@pytest.mark.parametrize("folder", engines.ENGINES)
def test_every_engine_keeps_the_whole_contract(folder):
    engine = import_module(f"speculators_train.engines.{folder}.engine").ENGINE
    assert isinstance(engine, Engine) and engine.name and engine.command_prefix.endswith(" ")
    if engine.doctor_check is not None:
        assert callable(engine.doctor())
    if not engine.verifies:
        assert folder not in sections()  # a section nothing reads
        return
    # verify refuses before any work what the engine cannot serve, so an engine it runs answers for itself
    assert type(engine).serving is not Engine.serving
    assert type(engine).decides_k is not Engine.decides_k  # its records decide the K of the formats it serves
    assert callable(engine.runner())
    assert engine.baselines
    section = sections()[folder]
    assert get_args(get_args(section.model_fields["baselines"].annotation)[0]) == engine.baselines


def test_names_prefixes_and_formats_belong_to_one_engine_each():
    every = engines.all_engines()
    formats = [f for e in every for f in e.export_formats]
    for values in ([e.name for e in every], [e.command_prefix for e in every], formats):
        assert len(values) == len(set(values)), values
    assert set(sections()) <= set(engines.ENGINES)
    # each format's engine, as doctor and export have always picked it; every other format is the first engine's
    assert [engines.for_format(f).name for f in ("gguf", "sglang", "speculators")] == ["llama.cpp", "sglang", "vllm"]


def test_the_serve_lines_an_export_prints_begin_with_their_engines_prefix():
    """A line no prefix matches is printed unchecked: each engine's line builder and its prefix agree."""
    from speculators_train.engines.llamacpp.server import serve_command
    from speculators_train.families.format_common import sglang_serve, vllm_serve

    lines = {
        "vllm": vllm_serve("target", {"method": "eagle3"}),
        "llama.cpp": serve_command("target.gguf", Path("draft.gguf"), None, 3),
        "sglang": sglang_serve("target", Path("draft"), "EAGLE3", 3, 1, 4),
    }
    assert set(lines) == set(engines.names())
    for name, line in lines.items():
        assert line.startswith(engines.get(name).command_prefix), line


def choices(command: str, dest: str) -> tuple[str, ...]:
    from speculators_train.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    return tuple(next(a for a in sub._actions if a.dest == dest).choices)


def doctors_engines(monkeypatch) -> list[str]:
    """The engines whose verify records doctor reads, in its order."""
    from speculators_train.doctor import run

    asked = []
    monkeypatch.setattr(run, "latest_verify_report", lambda recipe, path, name="native": asked.append(name))
    run.engine_checks(None, SimpleNamespace(path=Path("draft")), None, "none")
    return asked


def test_the_cli_the_recipe_and_doctor_list_the_registrys_engines(monkeypatch):
    ran_here = engines.verifying()
    assert set(ran_here) == {e.name for e in engines.all_engines() if e.verifies} and ran_here
    assert choices("verify", "engine") == ("native", *sorted(ran_here))
    assert get_args(EvalConfig.model_fields["engine"].annotation) == ("native", *sorted(ran_here))
    assert choices("doctor", "serve_engine") == engines.names()
    assert doctors_engines(monkeypatch) == list(ran_here)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_engine_whose_records_decide_an_exports_k_is_the_one_serving_its_format(family, tmp_path):
    """As export has always picked it: llama.cpp for a draft file beside the target's GGUF, vLLM for a format it
    serves as a speculative method, the loop for any other."""
    from speculators_train.export.run import served_engine

    for fmt in get(family).formats.values():
        vllm = fmt.vllm_speculative_config(tmp_path, 3) is not None
        expected = "llama.cpp" if fmt.draft_file else "vllm" if vllm else "native"
        assert served_engine(fmt, tmp_path, 3) == expected, fmt.name


def test_the_other_engine_choices_name_registered_engines():
    """`data.regenerate.engine` and `generation.engine` choose who runs the target's forward (transformers, or an
    engine's own runtime), not a serving engine; their engines are registered ones all the same."""
    from speculators_train.data.config import RegenerateConfig
    from speculators_train.hidden_states.config import GenerationConfig

    for section in (RegenerateConfig, GenerationConfig):
        named = set(get_args(section.model_fields["engine"].annotation)) - {"transformers"}
        assert named and named <= set(engines.names()), section


# -- a new engine: registered once, picked up everywhere ----------------------------------------------------------


class FakeEngine(Engine):
    name = "fake"
    command_prefix = "fake-serve "
    export_formats = ("fake-format",)
    verify_runner = "test_engines:fake_run"  # in this module's package, as an engine's is in its folder

    def serving(self, target: Any, target_config: Any, settings: Any, nextn_classes: Any = None) -> Serving:
        return Serving(self.name, problems=["it refuses"] if settings == "refused" else [], here=["elsewhere only"])

    def decides_k(self, export_format: Any, out: Path, k: int) -> bool:
        return True


def fake_run(recipe: Any, suites: Any, loaded: Any, out_dir: Path) -> list[dict[str, Any]]:
    return [{"engine": "fake"}]


@pytest.fixture
def fake(monkeypatch) -> Engine:
    """A fake engine registered as a folder is: its `engine` module, and one more name in `ENGINES`."""
    module = types.ModuleType("speculators_train.engines.fake.engine")
    module.ENGINE = FakeEngine()
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(engines, "ENGINES", (*engines.ENGINES, "fake"))
    return module.ENGINE


def test_a_registered_engine_is_picked_up_by_every_stage_without_other_edits(fake, monkeypatch):
    from speculators_train.export.run import served_engine

    assert engines.get("fake") is fake and engines.for_format("fake-format") is fake
    assert "fake" in choices("doctor", "serve_engine")
    assert doctors_engines(monkeypatch)[-1] == "fake"
    assert engines.get("fake").runner() is fake_run  # what `verify` runs for eval.engine: fake
    assert served_engine(SimpleNamespace(name="fake-format"), Path("out"), 3) == "fake"
    lines = ["fake-serve draft", "python -m sglang.launch_server --model-path t", "someone-else serve"]
    assert served_commands(None, None, "served", lines) == (lines, ["fake: elsewhere only"])
    assert served_commands(None, None, "refused", lines) == (lines[1:], ["no fake command: it refuses"])
    assert serving("fake", None, None, "served").here == ["elsewhere only"]


def test_an_engine_without_a_serving_check_gets_no_other_engines_answer():
    with pytest.raises(ValueError, match="'sglang' has no serving check"):
        serving("sglang", None, None, None)


REGISTER_FAKE = """
import sys, types
from speculators_train import engines
from speculators_train.engines.base import Engine

class FakeEngine(Engine):
    name, command_prefix, verify_runner = "fake", "fake-serve ", "verify:run"

module = types.ModuleType("speculators_train.engines.fake.engine")
module.ENGINE = FakeEngine()
sys.modules[module.__name__] = module
engines.ENGINES = (*engines.ENGINES, "fake")

from speculators_train.cli import build_parser
from speculators_train.eval_config import EvalConfig
from speculators_train.families import FAMILIES, get

print(EvalConfig(engine="fake").engine, build_parser().parse_args(["verify", "r.yaml", "--engine", "fake"]).engine)
"""


def test_eval_engine_and_verifys_choices_take_a_registered_engine():
    """Both are built when the recipe's schema is imported: a process that registers the engine first gets it."""
    done = subprocess.run([sys.executable, "-c", REGISTER_FAKE], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["fake", "fake"]


# -- no stage dispatches on an engine's name ----------------------------------------------------------------------

# `data.regenerate.engine` and `generation.engine` pick who runs the target's forward, and may be compared with an
# engine's name; their choices name `transformers` beside the engines.
OWN_CHOICES = re.compile(r"(regenerate|regen|generation)\.engine$")


def name_dispatch(source: str, names: set[str]) -> list[int]:
    """Lines of `source` that choose by an engine's name: a comparison with it, a dict keyed by it, or a list of
    two or more of them (a table of engines)."""
    found = []

    def named(node: ast.AST) -> bool:
        items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
        return any(isinstance(i, ast.Constant) and i.value in names for i in items)

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(map(named, operands)) and not any(OWN_CHOICES.search(ast.unparse(o)) for o in operands):
                found.append(node.lineno)
        elif isinstance(node, ast.Dict) and any(named(k) for k in node.keys if k is not None):
            found.append(node.lineno)
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            values = [e.value for e in node.elts if isinstance(e, ast.Constant)]
            if sum(v in names for v in values) >= 2 and "transformers" not in values:
                found.append(node.lineno)
    return sorted(set(found))


PROBE = """
if engine == "vllm": pass
if "llama.cpp" != recipe.eval.engine: pass
if engine in ("sglang",): pass
prefixes = {"vllm": "vllm serve "}
choices = ["native", "llama.cpp", "vllm"]
if regen.engine == "vllm" or recipe.generation.engine != "llama.cpp": pass
replies = ("transformers", "llama.cpp", "vllm")
message = "eval.engine 'vllm': vLLM drafts chains here"
"""


def test_no_stage_outside_the_engines_chooses_by_an_engines_name():
    """Stages ask the registry (`engines.get`, `for_format`, `verifying`); an engine's folder and the families (a
    family states its own limits in the engines that load its formats) are where the names are spelled."""
    names = set(engines.names())
    assert name_dispatch(PROBE, names) == [2, 3, 4, 5, 6]  # the check finds each kind of spelling
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.is_relative_to(PACKAGE / "engines") or path.is_relative_to(PACKAGE / "families"):
            continue
        offenders += [f"{path.relative_to(REPO)}:{n}" for n in name_dispatch(path.read_text(), names)]
    assert not offenders, offenders


def test_no_engine_folder_imports_another_engines():
    """What two engines share lives in `engines/` itself (`base.py`, `serving.py`), so a folder changes alone."""
    offenders = []
    for folder in engines.ENGINES:
        others = tuple(f"speculators_train.engines.{other}" for other in engines.ENGINES if other != folder)
        for path in (PACKAGE / "engines" / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module:
                    imported = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
                else:
                    imported = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
                bad = [m for m in imported if m in others or m.startswith(tuple(f"{o}." for o in others))]
                offenders += [f"{path.relative_to(REPO)}: {m}" for m in bad]
    assert not offenders, offenders


def test_the_places_a_new_engine_touches_are_few_and_exist():
    """docs/architecture.md lists where an engine is added outside its folder: at most three places, each a file."""
    text = (REPO / "docs" / "architecture.md").read_text()
    block = text.split("<!-- engine-places:start -->", 1)[1].split("<!-- engine-places:end -->", 1)[0]
    places = re.findall(r"^\d+\. `([^`]+)`", block, flags=re.MULTILINE)
    assert 1 <= len(places) <= 3, places
    for place in places:
        assert (REPO / place).is_file(), place


def test_f32_conversions_of_two_folders_of_one_name_are_kept_apart(tmp_path, monkeypatch):
    """llama.cpp's F32 copy of an HF target is cached per folder, not per folder name: `model/` under two projects,
    or one folder rewritten in place, must not be served the other's weights."""
    from speculators_train.engines.llamacpp import verify

    made = []
    monkeypatch.setenv("SPECULATORS_TRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(verify, "convert", lambda src, out, kind: (made.append(src), out.write_bytes(b"gguf")))
    a, b = tmp_path / "a" / "model", tmp_path / "b" / "model"
    for folder, weights in ((a, b"1"), (b, b"2")):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(weights)
    first, second = verify.f32_gguf(a), verify.f32_gguf(b)
    assert first != second and made == [a, b]
    assert verify.f32_gguf(a) == first and len(made) == 2  # converted once
    (a / "model.safetensors").write_bytes(b"rewritten")
    assert verify.f32_gguf(a) != first and len(made) == 3


def test_vllm_runs_a_target_with_recurrent_layers_in_bfloat16():
    """vLLM's CPU gated delta-net (Qwen3-Next's linear attention) runs in bfloat16 only: float32 stopped its engine
    at start. Other targets stay in float32, as the loop runs them."""
    from transformers import AutoConfig

    from speculators_train.engines.vllm.verify import engine_dtype

    assert engine_dtype(AutoConfig.for_model("llama")) == "float32"
    assert engine_dtype(AutoConfig.for_model("qwen3_next")) == "bfloat16"
