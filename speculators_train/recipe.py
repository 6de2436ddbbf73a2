"""The recipe: one validated YAML file that drives every stage (generate, train, export, verify, osd).

Each setting lives in exactly one place. The draft family is named once, in `draft: {family: ..., ...}`, whose
other keys are that family's own section (`speculators_train/families/<name>/settings.py`). Unknown keys and wrong
types fail with the file and the dotted key, e.g.
``recipes/eagle3.yaml: training.lerning_rate: unknown key (did you mean learning_rate?)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import Field, field_validator, model_validator

from speculators_train import families
from speculators_train.errors import UserError
from speculators_train.eval_config import EvalConfig
from speculators_train.families.base import Divergence
from speculators_train.schema import (
    DTypeName,
    Section,
    apply_overrides,
    read_yaml_mapping,
    validate_mapping,
)
from speculators_train.sources import TargetConfig, gguf_file


class RegenerateConfig(Section):
    """Replace assistant turns with the target's own responses (drafts trained on them accept more)."""

    enabled: bool = False
    temperature: float = Field(0.0, ge=0.0, description="0 is greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_new_tokens: int = Field(512, gt=0)
    batch_size: int = Field(16, gt=0, description="Prompts decoded together (llama.cpp: the server's parallel slots).")
    engine: Literal["transformers", "llama.cpp", "vllm"] = Field(
        "transformers",
        description="llama.cpp: llama-server decodes the replies from the target's GGUF file, `batch_size` at once "
        "in parallel slots (the quantized file that is served, not a float copy); vllm: vLLM's offline batch "
        "generation on the target's HF folder, each turn's requests in one call; hidden states are still captured "
        "in transformers.",
    )
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


class SelectConfig(Section):
    """Acceptance-guided data: fine-tune `training.init_from` on the stored samples it fails on."""

    keep: float = Field(gt=0, le=1, description="Share of the train samples kept.")
    by: Literal["acceptance", "uniform"] = Field(
        "acceptance",
        description="acceptance: the samples with the lowest teacher-forced acceptance length under the draft being "
        "fine-tuned; uniform: a seeded random subset of the same size (the control).",
    )


class TrainingConfig(Section):
    epochs: int = Field(1, gt=0)
    max_steps: int | None = Field(None, gt=0, description="Stop after this many optimizer steps (a budget).")
    max_minutes: float | None = Field(
        None,
        gt=0,
        description="A training-time budget: stop at the first optimizer step past it. Validation and checkpoints "
        "are not counted, a resumed run counts its earlier time, and the learning-rate schedule runs over the "
        "time instead of the steps (so such a run is not bit-reproducible).",
    )
    init_from: str | None = Field(
        None, description="A draft of the recipe's family to fine-tune: ours, or one in a layout the family reads."
    )
    select: SelectConfig | None = Field(
        None, description="Train on a subset of the stored samples (with init_from; offline hidden states)."
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


class ExportConfig(Section):
    format: str = Field("speculators", description="A layout of the draft's family (draft.family's formats).")
    dtype: DTypeName = Field("bfloat16", description="Float weights; d2t stays int64 and t2d bool.")
    verifier: str | None = Field(
        None, description="Where engines load the target from; default: its hub id (a local path otherwise)."
    )


class OSDConfig(Section):
    """Online distillation on production logs: ingestion, scoring, distillation and the promotion gate."""

    logs: str | None = Field(None, description="Directory of JSONL logs (the --logs option overrides it).")
    redact: list[str] = Field(
        default_factory=list, description="RE2 regexes replaced by [REDACTED] before storing (linear time)."
    )
    redact_builtin: bool = Field(
        True, description="Also apply the built-in rules (keys, tokens, passwords, personal data: osd/redact.py RULES)."
    )
    redact_hook: str | None = Field(None, description="'module:function' (str -> str) run after the regexes.")
    commit_every: int = Field(256, gt=0, description="Log lines per ingestion commit (the unit redone after a kill).")
    poll_seconds: float = Field(30.0, gt=0, le=86400, description="Pause between passes with --watch (a day at most).")
    init_from: str | None = Field(None, description="The deployed draft to adapt (checkpoint or export dir).")
    update_interval: int = Field(64, gt=0, description="Log records per distillation update.")
    steps_per_update: int = Field(16, gt=0, description="Optimizer steps per update, on batches from the buffer.")
    batch_size: int = Field(4, gt=0)
    learning_rate: float = Field(1e-4, gt=0)
    divergence: Divergence = Field(
        "forward_kl", description="Distillation divergence against the target (families/divergence.py)."
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
        draft, name = self.draft, self.draft.family
        problems = []
        blocker = next((p for p in (self.run_dir, *self.run_dir.parents) if p.exists()), None)
        if blocker is not None and not blocker.is_dir():
            problems.append(f"output_dir {str(self.run_dir)!r}: {blocker} is a file, the run needs a directory there")
        if self.export.format not in draft.formats:
            problems.append(f"export.format {self.export.format!r}: the {name} family writes {list(draft.formats)}")
        vocab = getattr(draft, "draft_vocab_size", None)
        if vocab is not None and self.eval.tree.top_k > vocab:
            problems.append(f"eval.tree.top_k {self.eval.tree.top_k}: the draft proposes from {vocab} tokens")
        if self.eval.tree.shape not in draft.tree_shapes:
            problems.append(f"eval.tree.shape {self.eval.tree.shape!r}: {name} drafts grow {list(draft.tree_shapes)}")
        if self.training.init_from and not draft.fine_tunes:
            problems.append(f"training.init_from: {name} drafts start fresh; remove it")
        problems += draft.recipe_problems(self)
        if self.training.select and not (self.training.init_from and self.generation.hidden_states == "offline"):
            problems.append(
                "training.select scores stored samples with the draft it fine-tunes: it needs training.init_from and "
                "generation.hidden_states: offline"
            )
        regen = self.data.regenerate
        if regen.enabled and regen.engine == "llama.cpp" and gguf_file(self.target) is None:
            problems.append(
                f"data.regenerate.engine 'llama.cpp': target {self.target.name_or_path!r} is not a GGUF file "
                "(llama.cpp serves GGUF); use engine 'transformers' or a .gguf target"
            )
        if self.eval.engine == "vllm":
            if "speculators" not in draft.formats:
                problems.append(
                    f"eval.engine 'vllm': vLLM serves no {draft.family} draft (it loads the speculators layout, "
                    f"which this family does not write); verify with 'native'"
                )
            if self.eval.mode == "tree":
                problems.append("eval.engine 'vllm': vLLM drafts chains here; set eval.mode: chain")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) if self.output_dir else Path("runs") / self.name

    @property
    def hidden_states_dir(self) -> Path:
        return self.run_dir / "hidden_states"


# The recipe of the embedded default (relative to a checkout): what the eval scripts run when given none.
DEFAULT_RECIPE = "recipes/eagle3.yaml"

# Keys that moved, so a recipe written for an earlier version is told where its setting lives now.
MOVED_KEYS = {"eval.cpu_packed_weights": "target.cpu_packed_weights"}


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
    old = _old_draft_layout(path, raw)
    if old:
        raise UserError(old)
    return validate_mapping(path, raw, Recipe, "recipe", MOVED_KEYS)
