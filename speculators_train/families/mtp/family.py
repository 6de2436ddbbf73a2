"""MTP heads as a registered family: one decoder layer of the target's own class fed its post-norm last state and
the next token, trained recursively over a few steps (FastMTP), the target's embedding and head shared."""

from __future__ import annotations

import torch

from speculators_train.families.base import DraftStart, Family
from speculators_train.families.mtp.checkpoint import target_mtp_tensors
from speculators_train.families.mtp.formats import from_files
from speculators_train.families.mtp.model import MTPConfig, MTPDraft, checked_mtp_config
from speculators_train.families.mtp.objective import MTPObjective
from speculators_train.families.mtp.proposer import MTPProposer
from speculators_train.families.mtp.settings import Settings
from speculators_train.head import HEAD_NORM_PREFIX, TargetHead
from speculators_train.loading import reading


class MTPFamily(Family):
    name = "mtp"
    settings = Settings
    title = "MTP head"
    step_label = "step"
    draft_type = MTPDraft
    config_type = MTPConfig
    config_reader = staticmethod(checked_mtp_config)
    proposer_type = MTPProposer
    not_saved = ("embed_tokens.weight",)  # the target's, frozen: restored from the target

    def new_draft(self, settings: Settings, start: DraftStart) -> MTPDraft:
        """From the target's own MTP layer where its checkpoint has one (DeepSeek-V3, GLM-4.5: `model.layers.{n}`),
        else the block at random (its class's own initialisation) and the three norms as the target's final norm;
        the embedding and head are the target's."""
        text = start.target_config.get_text_config()
        config = MTPConfig(
            layer_config=text.to_dict(),
            num_steps=settings.num_steps,
            target_num_layers=text.num_hidden_layers,
            style=settings.style,
        )
        own = target_mtp_tensors(start.target_dir, text.num_hidden_layers)
        if own:  # the target's own MTP layer: fine-tuned from where its makers left it
            config.from_target = True
        draft = MTPDraft(config)
        norm = {k[len(HEAD_NORM_PREFIX) :]: v for k, v in start.head.items() if k.startswith(HEAD_NORM_PREFIX)}
        with torch.no_grad():
            for module in (draft.enorm, draft.hnorm, draft.shared_norm):
                module.load_state_dict(norm)
            draft.embed_tokens.weight.copy_(start.head["embed"])
            draft.lm_head.weight.copy_(start.head["lm_head"])
        if own:
            with reading(start.target_dir, "the target's MTP layer"):
                mine = from_files(own, text, text.num_hidden_layers)
            draft.load_state_dict(mine, strict=False)
        return draft

    def attach_target(self, draft: MTPDraft, embed_weight: torch.Tensor, has_embedding: bool) -> None:
        if not has_embedding:
            with torch.no_grad():
                draft.embed_tokens.weight.copy_(embed_weight)

    def objective(
        self,
        draft: MTPDraft,
        head: TargetHead,
        settings: Settings,
        depth: int | None = None,
        divergence: str | None = None,
    ) -> MTPObjective:
        steps = min(depth or draft.config.num_steps, draft.config.num_steps)
        return MTPObjective(draft, head, settings.step_beta, divergence or settings.loss, steps)

    def card_rows(self, draft: MTPDraft, fmt: str, k: int) -> list[tuple[str, str]]:
        cfg = draft.config
        return [
            ("target states read", "the last decoder layer's output after the final norm"),
            ("block", f"one {type(draft.block).__name__}, the target's class at its MTP index {cfg.target_num_layers}"),
            ("steps trained", str(cfg.num_steps)),
            ("fed back", "the block's output before its norm" if cfg.style == "deepseek" else "the normed output"),
            ("vocabulary", f"the target's {cfg.target_vocab_size} ids (its embedding and head)"),
            ("speculative tokens", str(k)),
        ]


FAMILY = MTPFamily()
