"""The recipe's `osd:` section: ingestion, redaction, distillation and the promotion gate of online distillation.

Kept next to the OSD code that reads it, and apart from it so that loading a recipe imports no torch: the recipe
(`recipe.py`) composes this section.
"""

from __future__ import annotations

from pydantic import Field

from speculators_train.families.base import Divergence
from speculators_train.schema import Section


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
