"""The recipe: one validated YAML file that drives every stage (generate, train, export, verify).

Each setting lives in exactly one place. Unknown keys and wrong types fail with the file and the
dotted key, e.g. ``recipes/eagle3.yaml: training.lerning_rate: unknown key (did you mean learning_rate?)``.
"""

from __future__ import annotations

import difflib
import importlib.util
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from speculators_train.errors import UserError

DTypeName = Literal["float32", "bfloat16", "float16"]
M = TypeVar("M", bound="Section")


class Section(BaseModel):
    """Base for every recipe section: unknown keys are errors, never silently ignored."""

    model_config = ConfigDict(extra="forbid")

    # Where the YAML came from, for error messages and relative paths; not a key of the file.
    _source_path: Path | None = PrivateAttr(None)

    @property
    def source_path(self) -> Path | None:
        return self._source_path

    def resolve_path(self, value: str, key: str, directory: bool = False) -> Path:
        """A file named in this YAML: `pkg:PACKAGE/rel` (shipped in a Python package), absolute, or relative to
        this file's folder, then its parent (recipes/ and data/ sit side by side), then the working directory."""
        if value.startswith("pkg:"):
            package, _, rel = value[4:].partition("/")
            spec = importlib.util.find_spec(package)
            if spec is None or not spec.submodule_search_locations:
                raise UserError(f"{self.source_path}: {key}: package {package!r} is not installed")
            candidates = [Path(next(iter(spec.submodule_search_locations))) / rel]
        else:
            path = Path(value).expanduser()
            candidates = []
            if not path.is_absolute() and self.source_path is not None:
                candidates += [self.source_path.parent / path, self.source_path.parent.parent / path]
            candidates.append(path)
        for candidate in candidates:
            if candidate.is_dir() if directory else candidate.is_file():
                return candidate
        tried = ", ".join(str(c) for c in candidates)
        what = "directory" if directory else "file"
        raise UserError(f"{self.source_path}: {key}: {what} {value!r} not found (tried {tried})")


class TargetConfig(Section):
    name_or_path: str = Field(
        "smollm2-135m-instruct",
        description="Named default, hub id, local HF directory, or a .gguf file.",
    )
    gguf_file: str | None = Field(None, description="GGUF file name inside a directory or hub repo.")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit).")
    device: str = Field("auto", description="'auto' (CUDA if present, else CPU), 'cpu', 'cuda' or 'cuda:N'.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="'auto' is bfloat16 on CUDA and float32 on CPU."
    )
    aux_layer_ids: list[int] | None = Field(
        None,
        description="Residual-stream ids to capture (id k = after k decoder layers = HF hidden_states[k]); "
        "default [2, N//2, N-3].",
    )
    trust_remote_code: bool = False
    cpu_packed_weights: bool = Field(
        True,
        description="float32 on CPU: run the target's linears (in verify, the draft's too) on a copy of their "
        "weights packed for oneDNN: the generator ~1.5x and decode steps ~2x faster on a 2-core EPYC; "
        "one more copy of the linear weights in RAM while it runs.",
    )

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
            return value
        raise ValueError("must be 'auto', 'cpu', 'cuda' or 'cuda:N'")

    @field_validator("aux_layer_ids")
    @classmethod
    def _ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (not value or any(i < 0 for i in value)):
            raise ValueError("must be a non-empty list of non-negative layer ids")
        return value


class RegenerateConfig(Section):
    """Replace assistant turns with the target's own responses (drafts trained on them accept more)."""

    enabled: bool = False
    temperature: float = Field(0.0, ge=0.0, description="0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(512, gt=0)
    batch_size: int = Field(16, gt=0)
    max_turns: int | None = Field(None, gt=0, description="Keep only the first N exchanges of each conversation.")

    @classmethod
    def identity(cls, settings: dict[str, Any]) -> dict[str, Any]:
        """What decides the stored text: nothing but `enabled` when off, and a stored dict written before a
        setting existed reads as that setting's default, so adding an option never invalidates old outputs."""
        config = cls.model_validate(settings)
        return config.model_dump() if config.enabled else {"enabled": False}


class DataConfig(Section):
    mix: str = Field(description="Path to a data mix YAML (see data/*.yaml).")
    max_length: int = Field(2048, gt=1, description="Tokens per sample after the chat template.")
    overlong: Literal["truncate", "drop"] = Field("truncate", description="What to do past max_length.")
    held_out_fraction: float = Field(
        0.02, ge=0.0, lt=1.0, description="Share of record ids held out (decided by id hash, never trained on)."
    )
    regenerate: RegenerateConfig = Field(default_factory=RegenerateConfig)


class GenerationConfig(Section):
    hidden_states: Literal["offline", "online"] = Field(
        "offline", description="offline: write shards to disk; online: capture in memory while training."
    )
    storage_dtype: DTypeName = Field("bfloat16", description="dtype of stored hidden states.")
    samples_per_shard: int = Field(256, gt=0, description="Also the unit of resume after a crash.")
    max_tokens_per_batch: int = Field(8192, gt=0, description="Padded tokens per target forward.")


class WandbConfig(Section):
    mode: Literal["offline", "online", "disabled"] = Field("offline", description="offline: sync later.")
    project: str = "speculators_train"
    entity: str | None = None
    run_name: str | None = Field(None, description="Default: the recipe name.")


class DeepSpeedConfig(Section):
    zero_stage: Literal[1, 2] = Field(
        2, description="ZeRO-3 would shard the draft's weights, and stage 0 is plain DDP: neither is supported."
    )
    offload_optimizer: bool = False


class TrainingConfig(Section):
    algorithm: Literal["eagle3", "medusa"] = Field("eagle3", description="Which draft to train (its own section).")
    epochs: int = Field(1, gt=0)
    max_steps: int | None = Field(None, gt=0, description="Stop after this many optimizer steps (a budget).")
    init_from: str | None = Field(
        None, description="A draft to fine-tune: one of our checkpoints, or a speculators/SGLang EAGLE-3 directory."
    )
    learning_rate: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_ratio: float = Field(0.015, ge=0, lt=1, description="Share of steps spent in linear warmup.")
    batch_size: int = Field(8, gt=0, description="Samples per micro-batch on each rank.")
    gradient_accumulation_steps: int = Field(1, gt=0)
    max_grad_norm: float = Field(0.5, gt=0)
    gradient_checkpointing: bool = False
    length_bucketing: bool = Field(True, description="Batch samples of similar length (less padding).")
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = Field("auto", description="auto: bf16 on CUDA.")
    deepspeed: DeepSpeedConfig | None = Field(None, description="Set to use DeepSpeed ZeRO.")
    save_every_steps: int | None = Field(None, gt=0, description="Also checkpoint at each epoch end.")
    eval_every_steps: int | None = Field(None, gt=0, description="Also validate at each epoch end.")
    keep_last: int = Field(2, gt=0, description="Checkpoints kept besides the best.")
    log_every_steps: int = Field(10, gt=0)
    wandb: WandbConfig = Field(default_factory=WandbConfig)

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no(cls, value: Any) -> Any:
        """YAML 1.1 reads a bare `no` (in a file or a --set) as false; it means "no" here."""
        return "no" if value is False else value


class Eagle3Section(Section):
    draft_vocab_size: int = Field(8192, gt=0, description="Reduced vocab from the generator's token counts.")
    ttt_steps: int = Field(7, gt=0, description="Training-time test unroll depth.")
    step_decay: float = Field(0.8, gt=0, le=1, description="Loss weight of step i is step_decay**i.")
    norm_before_residual: bool = Field(False, description="SGLang only runs false.")


class MedusaSection(Section):
    num_heads: int = Field(4, gt=0, description="Head h predicts token t+2+h.")
    num_layers: int = Field(1, gt=0, description="Residual blocks x + SiLU(Wx + b) per head.")
    loss: Literal["soft", "hard"] = Field("soft", description="soft: distil the target's distribution; hard: labels.")
    head_decay: float = Field(0.8, gt=0, le=1, description="Loss weight of head h is head_decay**h.")
    draft_vocab_size: int = Field(8192, gt=0, description="Reduced vocab from the generator's token counts.")


class ExportConfig(Section):
    format: Literal["speculators", "sglang"] = "speculators"
    dtype: DTypeName = Field("bfloat16", description="Float weights; d2t stays int64 and t2d bool.")
    verifier: str | None = Field(
        None, description="Where engines load the target from; default: its hub id (a local path otherwise)."
    )


class TreeConfig(Section):
    top_k: int = Field(4, gt=0, description="Children per expanded node, and nodes expanded per depth.")
    depth: int = Field(5, gt=0, description="Draft steps per verify step.")
    budget: int = Field(24, gt=0, description="Draft nodes verified per step (the most probable).")
    shape: Literal["dynamic", "measured"] = Field(
        "dynamic",
        description="dynamic: each step keeps the `budget` most probable paths (any draft); measured (Medusa "
        "only): one fixed tree built from the checkpoint's held-out per-head rank accuracies, as Medusa does.",
    )


class EvalConfig(Section):
    suites: list[str] = Field(
        default_factory=lambda: ["eval/suites/sharegpt-held-out.yaml"], description="Suite YAML files."
    )
    mode: Literal["chain", "tree"] = "chain"
    num_speculative_tokens: int = Field(5, gt=0, description="K, draft tokens per verify step (chain mode).")
    tree: TreeConfig = Field(default_factory=TreeConfig)
    temperatures: list[float] = Field(default_factory=lambda: [0.0], description="0 = greedy; one run each.")
    top_p: float = Field(1.0, gt=0, le=1)
    num_prompts: int | None = Field(None, gt=0, description="Override every suite's prompt count.")
    max_new_tokens: int | None = Field(None, gt=0, description="Override every suite's generation length.")

    @field_validator("temperatures")
    @classmethod
    def _temperatures(cls, value: list[float]) -> list[float]:
        if not value or any(t < 0 for t in value):
            raise ValueError("must be a non-empty list of temperatures >= 0")
        return value


class OSDConfig(Section):
    """Online distillation on production logs: ingestion settings (SPEC section 8)."""

    logs: str | None = Field(None, description="Directory of JSONL logs (the --logs option overrides it).")
    redact: list[str] = Field(default_factory=list, description="Regexes replaced by [REDACTED] before storing.")
    redact_builtin: bool = Field(True, description="Also redact emails, API keys and bearer tokens.")
    redact_hook: str | None = Field(None, description="'module:function' (str -> str) run after the regexes.")
    commit_every: int = Field(256, gt=0, description="Log lines per ingestion commit (the unit redone after a kill).")
    poll_seconds: float = Field(30.0, gt=0, description="Pause between passes with --watch.")
    init_from: str | None = Field(None, description="The deployed draft to adapt (checkpoint or export dir).")
    update_interval: int = Field(64, gt=0, description="Log records per distillation update.")
    steps_per_update: int = Field(16, gt=0, description="Optimizer steps per update, on batches from the buffer.")
    batch_size: int = Field(4, gt=0)
    learning_rate: float = Field(1e-4, gt=0)
    divergence: Literal["ce", "forward_kl", "reverse_kl", "jsd", "tvd"] = Field(
        "forward_kl", description="Distillation divergence against the target (training/divergence.py)."
    )
    buffer_size: int = Field(128, gt=0, description="Records kept, favouring those the draft failed on.")
    held_out_fraction: float = Field(0.1, gt=0, lt=1, description="Log records kept out of training for the gate.")
    held_out_records: int = Field(64, gt=0, description="Cap on the held-out log slice.")
    general_records: int = Field(
        32, gt=0, description="Prompts of the eval.suites (answered by the target, frozen) the gate holds versions to."
    )
    min_gain: float = Field(0.0, ge=0, description="Promote only if the log-slice AL rises by more than this.")
    general_margin: float = Field(0.02, ge=0, description="Largest general-suite AL loss a promotion may cost.")
    restart_after_refusals: int = Field(
        2,
        gt=0,
        description="The candidate keeps training across windows (optimizer state too); after this many refusals in a "
        "row it restarts from the deployed version.",
    )


class Recipe(Section):
    name: str = Field(description="Run name; also the default run directory runs/<name>.")
    output_dir: str | None = Field(None, description="Run directory; default runs/<name>.")
    seed: int = Field(0, description="Seed for data order and any sampling.")
    target: TargetConfig = Field(default_factory=TargetConfig)
    data: DataConfig
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    eagle3: Eagle3Section = Field(default_factory=Eagle3Section)
    medusa: MedusaSection = Field(default_factory=MedusaSection)
    export: ExportConfig = Field(default_factory=ExportConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    osd: OSDConfig = Field(default_factory=OSDConfig)

    @model_validator(mode="after")
    def _name(self) -> Recipe:
        if not self.name or "/" in self.name:
            raise ValueError("name must be a non-empty string without '/'")
        if self.data.max_length <= self.eagle3.ttt_steps + 1:
            raise ValueError(
                f"data.max_length ({self.data.max_length}) must exceed eagle3.ttt_steps + 1 "
                f"({self.eagle3.ttt_steps + 1})"
            )
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) if self.output_dir else Path("runs") / self.name

    @property
    def hidden_states_dir(self) -> Path:
        return self.run_dir / "hidden_states"


# Keys that moved, so a recipe written for an earlier version is told where its setting lives now.
MOVED_KEYS = {"eval.cpu_packed_weights": "target.cpu_packed_weights"}


def _format_error(path: Path, error: dict[str, Any], model: type[BaseModel]) -> str:
    loc = [str(part) for part in error["loc"]]
    key = ".".join(loc) or "<root>"
    if error["type"] == "extra_forbidden" and key in MOVED_KEYS:
        return f"{path}: {key}: moved to {MOVED_KEYS[key]}"
    if error["type"] == "extra_forbidden":
        allowed = _allowed_keys(model, loc[:-1])
        hint = difflib.get_close_matches(loc[-1], allowed, n=1)
        suggestion = f" (did you mean {hint[0]}?)" if hint else f" (allowed: {', '.join(sorted(allowed))})"
        return f"{path}: {key}: unknown key{suggestion}"
    if error["type"] == "missing":
        return f"{path}: {key}: required key is missing"
    return f"{path}: {key}: {error['msg']} (got {error.get('input')!r})"


def _allowed_keys(model: type[BaseModel], loc: list[str]) -> list[str]:
    for part in loc:
        field = model.model_fields.get(part)
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def load_yaml_model(path: str | Path, model: type[M], what: str, overrides: dict[str, Any] | None = None) -> M:
    """Load a YAML mapping into `model`; every problem is reported as `file: dotted.key: what is wrong`."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} {path} not found")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}:{mark.column + 1}" if mark else ""
        raise UserError(f"{path}{where}: not valid YAML: {getattr(exc, 'problem', exc)}") from None
    if not isinstance(raw, dict):
        raise UserError(f"{path}: a {what} must be a YAML mapping, got {type(raw).__name__}")
    for dotted, value in (overrides or {}).items():
        node = raw
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UserError(f"override {dotted}: {part} is not a section")
        node[leaf] = value
    try:
        loaded = model.model_validate(raw)
    except ValidationError as exc:
        messages = [_format_error(path, err, model) for err in exc.errors()]
        raise UserError(f"invalid {what}:\n  " + "\n  ".join(messages)) from None
    loaded._source_path = path
    return loaded


def load_recipe(path: str | Path, overrides: dict[str, Any] | None = None) -> Recipe:
    return load_yaml_model(path, Recipe, "recipe", overrides)


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` options as `load_recipe` overrides; values are YAML (`--set eval.temperatures=[0,1]`)."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UserError(f"--set {pair!r}: expected KEY=VALUE, e.g. --set data.max_length=512")
        out[key] = yaml.safe_load(value)
    return out
