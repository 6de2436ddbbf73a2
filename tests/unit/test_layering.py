"""The package's shape: stage packages import each other without cycles, and only `families/` names a family."""

import ast
import re
import subprocess
import sys

from speculators_train.families import FAMILIES
from tests.conftest import REPO

PACKAGE = REPO / "speculators_train"


def _imports(tree: ast.Module, module: str, type_only: bool = True) -> set[str]:
    """Every speculators_train module `tree` imports, at any depth (function-level imports included), and with
    `type_only` those of `if TYPE_CHECKING:` blocks too: a type-only edge is still a dependency of the design."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test) and not type_only:
                for stmt in child.orelse:
                    visit(stmt)
                continue
            if isinstance(child, ast.Import):
                out.update(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:  # relative: resolve against this module's package
                    base = module.rsplit(".", child.level)[0]
                    name = f"{base}.{child.module}" if child.module else base
                else:
                    name = child.module or ""
                out.add(name)
                out.update(f"{name}.{alias.name}" for alias in child.names)
            visit(child)

    visit(tree)
    return {name for name in out if name.startswith("speculators_train.")}


# The modules of an engine folder that run a stage through the engine: they use the stages above the engines'
# layer, and an engine names them as "module:attr" strings (`engines/base.py`), never by an import from below.
ENGINE_STAGES = ("verify", "doctor")


def _unit(module: str) -> str:
    """The layering unit of a module: the stage package or top-level module right under speculators_train. A stage's
    `config` module (its recipe section, plain data the recipe composes) is a unit of its own, `<stage>.config`: the
    stage imports the recipe, and the recipe imports the section, never the stage. So is each engine folder's
    `verify` and `doctor` module, `engines.verify` and `engines.doctor`: the engine's part of those stages."""
    parts = module.split(".")
    if len(parts) > 3 and parts[1] == "engines" and parts[3] in ENGINE_STAGES:
        return f"engines.{parts[3]}"
    return f"{parts[1]}.config" if len(parts) > 2 and parts[2] == "config" else parts[1]


def unit_graph(type_only: bool = True) -> dict[str, set[str]]:
    known = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir() if p.suffix == ".py" or p.is_dir()}
    known |= {f"{p.parent.name}.config" for p in PACKAGE.glob("*/config.py")}
    known |= {f"engines.{stage}" for stage in ENGINE_STAGES}
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if module == "speculators_train" or _unit(module) in ("__init__", "__main__"):
            continue
        edges = graph.setdefault(_unit(module), set())
        for name in _imports(ast.parse(path.read_text()), module, type_only):
            target = _unit(name) if name.count(".") else ""
            if target in known and target != _unit(module) and target != "__init__":
                edges.add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle_between_stage_packages():
    graph = unit_graph()
    assert {"training", "export", "verify", "families", "osd", "recipe"} <= graph.keys()
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)
    # The layering the package is built on: stages sit on the families, never the other way round.
    assert not graph["families"] & {"training", "export", "verify", "osd", "cli", "hidden_states", "data", "recipe"}
    assert "training" not in graph["export"] and "export" not in graph["training"]
    # The recipe composes the stages' sections, and a section names no stage: loading a recipe loads no stage code.
    stages = {"data", "hidden_states", "training", "export", "verify", "osd", "engines"}
    sections = {unit for unit in graph if unit.endswith(".config")}
    assert {"data.config", "training.config", "osd.config"} <= sections
    assert not graph["recipe"] & stages
    for section in sections:
        assert not graph[section] & (stages | {"recipe"}), section


def test_type_only_imports_count_as_edges():
    """A cycle closed only by an `if TYPE_CHECKING:` import is still a cycle of the design: such edges count."""
    typed, runtime = unit_graph(type_only=True), unit_graph(type_only=False)
    assert "eval_config" in typed["families"] - runtime["families"]  # families/base.py names it for types only


def test_the_cli_and_every_shipped_recipe_load_without_torch():
    """`--help`, every recipe error and every eval script's argument check pay no torch or transformers import."""
    code = """
import sys
import speculators_train.cli
from speculators_train.recipe import load_recipe
for path in sys.argv[1:]:
    load_recipe(path)
heavy = sorted(m for m in ("torch", "transformers", "safetensors", "accelerate", "vllm") if m in sys.modules)
print(",".join(heavy))
"""
    recipes = sorted(str(p) for p in (REPO / "recipes").glob("*.yaml"))
    done = subprocess.run([sys.executable, "-c", code, *recipes], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"imported: {done.stdout.strip()}"
    assert len(recipes) >= 5


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"training": {"export"}, "export": {"families", "training"}, "families": set()}) == [
        "export",
        "training",
        "export",
    ]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


# Every registered name (one of three letters or fewer as a lowercase word: "mlp" is also a target's layer), any
# case of it, and the spellings of a family's classes and papers that are not its name.
_REGISTERED = [rf"\b{n}\b" if len(n) <= 3 else rf"(?i:{n})" for n in FAMILIES]
FAMILY_NAMES = re.compile("|".join([*_REGISTERED, "mlp_speculator", "P-EAGLE", "StandaloneDraft", "MLPDraft"]))
RECIPE_FILE = re.compile(rf"recipes/({'|'.join(FAMILIES)})[\w.-]*\.yaml")
# An engine's own vocabulary: llama.cpp's GGUF architectures "eagle3" (with the speculative type it must be told for
# it) and "dflash" (which it detects from the file), vLLM's speculative_config key "draft_model_config" and its model
# interface `SupportsEagle3` (what a target class must implement to hand a draft its intermediate states); and
# transformers' layer types "mlp" and "moe" (Nemotron-H's blocks without a token mixer).
ENGINE_WORDS = re.compile(
    r'"eagle3": "draft-eagle3"|\{"dflash"\}|DFlash and DSpark drafts \(GGUF architecture `dflash`\)'
    r'|"draft_model_config"|SupportsEagle3|supports_eagle3|\{"mlp", "moe"\}'
)


def test_only_the_families_name_a_family():
    """Stages, the CLI and the eval scripts dispatch through the registry; recipe file names and an engine's own
    names for a file it loads are the exceptions."""
    offenders = []
    for path in [*PACKAGE.rglob("*.py"), *(REPO / "eval").glob("*.py")]:
        if path.is_relative_to(PACKAGE / "families"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if FAMILY_NAMES.search(ENGINE_WORDS.sub("", RECIPE_FILE.sub("", line))):
                offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_no_family_imports_another_familys_folder():
    """What two families share lives outside both (`families/eagle/`, `families/vocab.py`, ...), so a family
    folder can change without breaking another; type-only imports count."""
    from speculators_train.families import FAMILIES

    offenders = []
    for name in FAMILIES:
        for path in (PACKAGE / "families" / name).rglob("*.py"):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            for imported in _imports(ast.parse(path.read_text()), module):
                parts = imported.split(".")
                if len(parts) > 2 and parts[1] == "families" and parts[2] in FAMILIES and parts[2] != name:
                    offenders.append(f"{path.relative_to(REPO)} imports {imported}")
    assert not offenders, "\n".join(offenders)


def test_the_drawing_of_the_layers_matches_the_imports():
    """docs/architecture.md draws the units in layers: every unit is on one line, and no unit imports one drawn
    above it (type-only imports included)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    block = text.split("<!-- layers:start -->", 1)[1].split("<!-- layers:end -->", 1)[0].strip("`\n ")
    rows = []
    for line in block.splitlines():
        names = re.split(r"\s{2,}", line.strip("` "))[0]
        rows.append({name.strip() for name in names.split("·")})
    drawn = {name: depth for depth, row in enumerate(rows) for name in row}
    graph = unit_graph(type_only=True)
    assert set(graph) <= set(drawn), sorted(set(graph) - set(drawn))
    upward = [(unit, dep) for unit, deps in graph.items() for dep in deps if drawn[dep] < drawn[unit]]
    level = [(unit, dep) for unit, deps in graph.items() for dep in deps if dep != unit and drawn[dep] == drawn[unit]]
    assert not upward and not level, (upward, level)


def _run_name_offences(path, names: set[str], dirs: set[str]) -> list[str]:
    """Where `path` spells one of a run's file names (`names`, outside docstrings) or joins one of its directory
    names (`dirs`, as the right side of a `/`)."""
    tree = ast.parse(path.read_text())
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if any(name in node.value for name in names):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            right = node.right
            if isinstance(right, ast.Constant) and right.value in dirs:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: / {right.value!r}")
            spelled = ast.unparse(right)[2:]  # past f and its quote
            if isinstance(right, ast.JoinedStr) and spelled.startswith(("step-", ".shards-", "v{", "rank{")):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(right)}")
    return found


def test_only_the_layout_names_a_runs_files():
    """A stage reads another stage's files through `layout.py` (an import the drawing above sees), never by a
    literal name: checkpoints, their pointers, trainer state and FSDP2's staging, the trainer's log, verify's and
    doctor's reports, OSD's store and ingestion, the hidden states' manifest and the run's stage directories are
    spelled there alone (eval scripts included)."""
    from speculators_train import layout

    names = {layout.TRAINER_STATE, layout.OPTIMIZER, layout.LATEST, layout.BEST, layout.METRICS, layout.RESULTS}
    names |= {layout.DRAFT_CONFIG, layout.RESULTS_REPORT, layout.ACCEPTANCE_PLOT, layout.RUN_INFO}
    names |= {layout.DOCTOR_REPORT, layout.DOCTOR_RESULTS, layout.MANIFEST, layout.TOKEN_FREQ}
    names |= {layout.OSD_PROGRESS, layout.OSD_GENERAL, layout.OSD_HISTORY, layout.INGEST_STATE, ".shards-"}
    dirs = {"train", "checkpoints", "verify", "export", "osd", "doctor", "hidden_states", "progress"}
    dirs |= {"ingest", "segments", "versions", "trainee", "current", "checkpoint"}
    paths = [p for p in [*PACKAGE.rglob("*.py"), *(REPO / "eval").glob("*.py")] if p != PACKAGE / "layout.py"]
    offences = [line for path in paths for line in _run_name_offences(path, names, dirs)]
    assert not offences, "\n".join(offences)
    # The check itself finds each kind of spelling.
    probe = REPO / "tests" / "unit" / "_layout_probe.py"
    probe.write_text(
        'x = run / "train" / "checkpoints" / f"step-{s:06d}" / "trainer_state.json"\n'
        'y = run / "osd" / "versions" / f"v{v:04d}" / "checkpoint" / f".shards-{s:06d}"\n'
        'z = run / "doctor" / "doctor.md", osd / "progress.json", run / "hidden_states" / "manifest.json"\n'
    )
    try:
        assert len(_run_name_offences(probe, names, dirs)) == 15
    finally:
        probe.unlink()


def test_no_module_over_400_lines_and_no_function_over_60():
    """A module holds one job a newcomer reads in one sitting, and a function fits on a screen."""
    long_modules, long_functions = [], []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if text.count("\n") > 400:
            long_modules.append(f"{path.relative_to(REPO)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long_functions.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}")
    assert not long_modules and not long_functions, (long_modules, long_functions)
