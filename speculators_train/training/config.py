"""The recipe's `training:` section with its sub-sections (selection, DeepSpeed, FSDP, wandb).

Kept next to the trainer that reads it, and apart from it so that loading a recipe imports no torch: the recipe
(`recipe.py`) composes this section.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from speculators_train.schema import Section


class WandbConfig(Section):
    mode: Literal["offline", "online", "disabled"] = Field("offline", description="offline: sync later.")
    project: str = "speculators_train"
    entity: str | None = None
    run_name: str | None = Field(None, description="Default: the recipe name.")


class DeepSpeedConfig(Section):
    zero_stage: Literal[1, 2, 3] = Field(
        2,
        description="1: optimizer state sharded; 2: and gradients; 3: and the weights (the draft's and the frozen "
        "target head's), gathered for each forward. Stage 0 is plain DDP: leave training.deepspeed unset.",
    )
    offload_optimizer: bool = False


class FSDPConfig(Section):
    """FSDP2 (`fully_shard`, through accelerate): every weight, gradient and Adam moment of the objective sharded
    across the ranks."""

    reshard_after_forward: bool = Field(
        True,
        description="true: free each rank's gathered weights after the forward and gather them again for the "
        "backward (ZeRO-3's memory); false: keep them until the backward (ZeRO-2-like, one all-gather a step).",
    )
    cpu_offload: bool = Field(False, description="Keep the shards and optimizer state in CPU memory (CUDA runs).")


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
        None, description="A draft of the recipe's family to fine-tune: ours, or one in a format the family reads."
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
    fsdp: FSDPConfig | None = Field(None, description="Set to use FSDP2 (not with deepspeed).")
    save_every_steps: int | None = Field(None, gt=0, description="Also checkpoint at each epoch end.")
    eval_every_steps: int | None = Field(None, gt=0, description="Also validate at each epoch end.")
    keep_last: int = Field(2, gt=0, description="Checkpoints kept besides the best.")
    log_every_steps: int = Field(10, gt=0)
    wandb: WandbConfig = Field(default_factory=WandbConfig)

    @model_validator(mode="after")
    def _one_sharding(self) -> TrainingConfig:
        if self.deepspeed is not None and self.fsdp is not None:
            raise ValueError("training.deepspeed and training.fsdp are both set: pick one way to shard")
        return self

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no(cls, value: Any) -> Any:
        """YAML 1.1 reads a bare `no` (in a file or a --set) as false; it means "no" here."""
        return "no" if value is False else value
