"""The recipe: one validated YAML file that drives every stage (generate, train, export, verify, osd).

Each setting lives in exactly one place. The draft family is named once, in `draft: {family: ..., ...}`, whose
other keys are that family's own section (`speculators_train/families/<name>/settings.py`). Unknown keys and wrong
types fail with the file and the dotted key, e.g.
``recipes/eagle3.yaml: training.lerning_rate: unknown key (did you mean learning_rate?)``.

A stage's section lives next to that stage (`data/config.py`, `hidden_states/config.py`, `training/config.py`,
`export/config.py`, `osd/config.py`; `target:` in `origin.py`, `eval:` in `eval_config.py`), none of them importing
torch; this module composes them into `Recipe`, with the rules that tie sections together.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Union

import yaml
from pydantic import Field, model_validator

from speculators_train import families, layout
from speculators_train.data.config import DataConfig
from speculators_train.errors import UserError
from speculators_train.eval_config import EvalConfig
from speculators_train.export.config import ExportConfig
from speculators_train.folders import check_model_folder
from speculators_train.hidden_states.config import GenerationConfig
from speculators_train.origin import TargetConfig, gguf_file
from speculators_train.osd.config import OSDConfig
from speculators_train.schema import Section, apply_overrides, read_yaml_mapping, validate_mapping
from speculators_train.training.config import TrainingConfig

# The `draft:` section: the settings of one registered family, chosen by its `family` key.
DraftSettings = Annotated[Union[families.settings_types()], Field(discriminator="family")]  # noqa: UP007


class Recipe(Section):
    name: str = Field(description="Run name; also the default run directory runs/<name>.")
    output_dir: str | None = Field(None, description="Run directory; default runs/<name>.")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Seed for data order and any sampling (numpy's range).")
    target: TargetConfig = Field(default_factory=TargetConfig)
    data: DataConfig
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    draft: DraftSettings = Field(
        default_factory=lambda: families.settings_types()[0](),
        description="The draft family (`family: NAME`) and that family's settings.",
    )
    export: ExportConfig = Field(default_factory=ExportConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    osd: OSDConfig = Field(default_factory=OSDConfig)

    @model_validator(mode="after")
    def _rules(self) -> Recipe:
        if not self.name or "/" in self.name or "\\" in self.name or self.name in (".", "..") or "\0" in self.name:
            raise ValueError("name must be a non-empty string without '/', and not '.' or '..' (it names a directory)")
        problems = []
        blocker = next((p for p in (self.run_dir, *self.run_dir.parents) if p.exists()), None)
        if blocker is not None and not blocker.is_dir():
            problems.append(f"output_dir {str(self.run_dir)!r}: {blocker} is a file, the run needs a directory there")
        if self.export.format is None:
            self.export.format = next(iter(self.draft.formats))
        problems += self._draft_problems() + self._engine_problems()
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _draft_problems(self) -> list[str]:
        """Rules between the draft section and the others (its family's own included)."""
        draft, name = self.draft, self.draft.family
        problems = []
        if self.export.format not in draft.formats:
            problems.append(f"export.format {self.export.format!r}: the {name} family writes {list(draft.formats)}")
        vocab = getattr(draft, "draft_vocab_size", None)
        if vocab is not None and self.eval.tree.top_k > vocab:
            problems.append(f"eval.tree.top_k {self.eval.tree.top_k}: the draft proposes from {vocab} tokens")
        if self.eval.tree.shape not in draft.tree_shapes:
            problems.append(f"eval.tree.shape {self.eval.tree.shape!r}: {name} drafts grow {list(draft.tree_shapes)}")
        if self.training.init_from and not draft.fine_tunes:
            problems.append(f"training.init_from: {name} drafts start fresh; remove it")
        if self.eval.draft_p_min and self.eval.engine == "native" and not draft.predicts_acceptance:
            problems.append(
                f"eval.draft_p_min: this loop stops chains only by a confidence head, which {name} drafts lack "
                "(llama.cpp applies it to any draft: eval.engine 'llama.cpp')"
            )
        problems += draft.recipe_problems(self)
        if self.training.select and not (self.training.init_from and self.generation.hidden_states == "offline"):
            problems.append(
                "training.select scores stored samples with the draft it fine-tunes: it needs training.init_from and "
                "generation.hidden_states: offline"
            )
        return problems

    def _engine_problems(self) -> list[str]:
        """Rules on which engine regenerates, captures and verifies, against the target and each other (the verifying
        engine's own: `Engine.recipe_problems`)."""
        problems = []
        regen = self.data.regenerate
        if regen.enabled and regen.engine == "llama.cpp" and gguf_file(self.target) is None:
            problems.append(
                f"data.regenerate.engine 'llama.cpp': target {self.target.name_or_path!r} is not a GGUF file "
                "(llama.cpp serves GGUF); use engine 'transformers' or a .gguf target"
            )
        if regen.enabled and regen.engine != "llama.cpp" and regen.model is not None:
            try:  # a folder from elsewhere, before transformers or vLLM reads it
                check_model_folder(regen.model, "data.regenerate.model")
            except UserError as exc:
                problems.append(str(exc))
        if regen.enabled and regen.engine == "llama.cpp" and regen.model is not None:
            problems.append(
                f"data.regenerate.model {regen.model!r}: engine 'llama.cpp' replies from the target's GGUF file; "
                "use engine 'transformers' or 'vllm' to reply with another model"
            )
        if self.generation.engine == "vllm":
            if self.generation.hidden_states == "online":
                problems.append(
                    "generation.engine 'vllm' writes stored shards; online states are captured by the transformers "
                    "copy that training holds: set generation.hidden_states: offline or generation.engine: "
                    "transformers"
                )
            if regen.enabled and regen.engine == "transformers":
                problems.append(
                    "data.regenerate.engine 'transformers' with generation.engine 'vllm': it would load the "
                    "transformers weights that the vLLM capture exists to avoid; regenerate with engine 'vllm' "
                    "or 'llama.cpp'"
                )
        elif self.generation.tensor_parallel_size > 1:
            problems.append("generation.tensor_parallel_size: only generation.engine 'vllm' splits the target")
        return problems + self.eval.engine_problems(self)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) if self.output_dir else Path("runs") / self.name

    @property
    def hidden_states_dir(self) -> Path:
        return layout.hidden_states_dir(self.run_dir)


# The recipe of the embedded default (relative to a checkout): what the eval scripts run when given none.
DEFAULT_RECIPE = "recipes/eagle3.yaml"

# Keys that moved, so a recipe written for an earlier version is told where its setting lives now.
MOVED_KEYS = {"eval.cpu_packed_weights": "target.cpu_packed_weights"}


# Model folders (or files) a recipe names by a relative path, like the files it names (`Section.resolve_path`)
FOLDER_KEYS = (("target", "name_or_path"), ("draft", "start"), ("data", "regenerate", "model"))


def _folders_beside(path: Path, raw: dict[str, Any]) -> None:
    """A relative model path that is not there from the working directory is read from the recipe's folder, then
    its parent, where it is there: a recipe keeps working when run from elsewhere (a hub id stays one)."""
    for *sections, key in FOLDER_KEYS:
        holder: Any = raw
        for name in sections:
            holder = holder.get(name) if isinstance(holder, dict) else None
        value = holder.get(key) if isinstance(holder, dict) else None
        if not isinstance(value, str) or not value or Path(value).expanduser().is_absolute() or Path(value).exists():
            continue
        found = next((base / value for base in (path.parent, path.parent.parent) if (base / value).exists()), None)
        if found is not None:
            holder[key] = str(found)


def _old_draft_layout(path: Path, raw: dict[str, Any]) -> str | None:
    """The one-line fix for a recipe in the layout before `draft:` (training.algorithm plus a section named after
    the family), showing the new spelling with the recipe's own values."""
    training = raw.get("training") if isinstance(raw.get("training"), dict) else {}
    sections = [name for name in families.FAMILIES if name in raw]
    if "algorithm" not in training and not sections:
        return None
    name = training.get("algorithm") or (sections[0] if sections else families.FAMILIES[0])
    old = raw.get(name) if isinstance(raw.get(name), dict) else {}
    spelling = yaml.safe_dump(
        {"draft": {"family": name, **old}}, default_flow_style=True, sort_keys=False, width=1 << 16
    ).strip()
    keys = ["training.algorithm"] * ("algorithm" in training) + [f"{s}:" for s in sections]
    return f"{path}: {', '.join(keys)} is the old layout; the draft family and its settings now read {spelling}"


def load_recipe(path: str | Path, overrides: dict[str, Any] | None = None) -> Recipe:
    path = Path(path)
    raw = read_yaml_mapping(path, "recipe")
    apply_overrides(raw, overrides or {})
    _folders_beside(path, raw)
    old = _old_draft_layout(path, raw)
    if old:
        raise UserError(old)
    return validate_mapping(path, raw, Recipe, "recipe", MOVED_KEYS)
