"""Medusa heads as a registered family: they read the target's last hidden state, train one loss per head, and
export in vLLM's Medusa format; their measured tree comes from each checkpoint's held-out rank accuracies."""

from __future__ import annotations

from typing import Any

import torch

from speculators_train.errors import UserError
from speculators_train.families.base import DraftStart, Family
from speculators_train.families.medusa.model import MedusaConfig, MedusaDraft, checked_config
from speculators_train.families.medusa.objective import MedusaObjective
from speculators_train.families.medusa.proposer import MedusaProposer, measured_tree
from speculators_train.families.medusa.settings import Settings
from speculators_train.families.objective import key
from speculators_train.families.vocab import build_vocab_mapping, draft_to_target
from speculators_train.head import TargetHead
from speculators_train.proposal import TreeSpec


def rank_accuracies(held_out: dict[str, Any], heads: int) -> list[list[float]]:
    """Per-head rank accuracies [head][rank] among a checkpoint's held-out metrics."""
    out = []
    for h in range(heads):
        row = []
        while key(f"rank{len(row)}_acc", h) in held_out:
            row.append(float(held_out[key(f"rank{len(row)}_acc", h)]))
        out.append(row)
    if not all(out):
        raise UserError(
            "eval.tree.shape 'measured' needs the held-out per-head rank accuracies that a Medusa checkpoint "
            "trained by this toolkit records; this one has none (use shape 'dynamic')"
        )
    return out


class MedusaFamily(Family):
    name = "medusa"
    settings = Settings
    title = "Medusa heads"
    step_label = "head"
    draft_type = MedusaDraft
    config_type = MedusaConfig
    config_reader = staticmethod(checked_config)
    proposer_type = MedusaProposer

    def new_draft(self, settings: Settings, start: DraftStart) -> MedusaDraft:
        """Blocks at zero, so each head starts as the target's lm_head rows of the draft vocabulary."""
        d2t, t2d = build_vocab_mapping(start.token_freq, min(settings.draft_vocab_size, start.token_freq.numel()))
        rows = start.head["lm_head"][draft_to_target(d2t)]
        return MedusaDraft.for_target(start.target_config, rows, d2t, t2d, settings.num_heads, settings.num_layers)

    def attach_target(self, draft: MedusaDraft, embed_weight: torch.Tensor, has_embedding: bool) -> None:
        """Heads take nothing from the target's weights: they read its state through its own final norm."""

    def objective(
        self,
        draft: MedusaDraft,
        head: TargetHead,
        settings: Settings,
        depth: int | None = None,
        divergence: str | None = None,
    ) -> MedusaObjective:
        """Every head is scored whatever `depth`; a `divergence` distils the target's distribution (soft)."""
        hard = settings.loss == "hard" and divergence is None
        return MedusaObjective(draft, head, settings.head_decay, hard, divergence or "ce")

    def max_draft_tokens(self, draft: MedusaDraft) -> int:
        return draft.config.num_heads

    def tree(self, draft: MedusaDraft, tree: Any, held_out: dict[str, Any]) -> TreeSpec:
        """Medusa's construction for shape 'measured': one fixed tree of the `budget` rank paths with the highest
        product of the checkpoint's measured rank accuracies."""
        if tree.shape != "measured":
            return super().tree(draft, tree, held_out)
        depth = self.draft_tokens(draft, tree.depth)
        paths = measured_tree(rank_accuracies(held_out, depth), tree.budget)
        return TreeSpec(tree.top_k, depth, tree.budget, paths)

    def card_rows(self, draft: MedusaDraft, fmt: str, k: int) -> list[tuple[str, str]]:
        cfg = draft.config
        return [
            ("target states read", "the last decoder layer's output after the final norm"),
            ("heads", f"{cfg.num_heads} (head h proposes the token h+2 after the last verified one)"),
            ("residual blocks per head", str(cfg.num_layers)),
            ("draft vocabulary", f"{cfg.draft_vocab_size} of {cfg.target_vocab_size} target ids (`token_map`)"),
            ("speculative tokens", str(k)),
        ]


FAMILY = MedusaFamily()
