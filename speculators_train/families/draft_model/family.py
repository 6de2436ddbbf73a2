"""The standalone draft model as a registered family: a small causal LM with the target's tokenizer, started from
some of the target's layers or from a smaller model, distilled from the target's distribution, served by engines
as a plain model folder."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from speculators_train.errors import UserError
from speculators_train.families.base import Family
from speculators_train.families.draft_model.model import DraftModelConfig, StandaloneDraft, checked_config, model_config
from speculators_train.families.draft_model.objective import DraftModelObjective
from speculators_train.families.draft_model.proposer import DraftModelProposer
from speculators_train.families.draft_model.settings import Settings
from speculators_train.target import NO_STATES, StateSpec, Target, TargetHead


def starting_model(settings: Settings, target_dir: str) -> nn.Module:
    """The LM a new draft copies: the target cut to `settings.layers`, a random model of the target's architecture
    (`fresh`), or the model `settings.start` names, whose tokenizer must be the target's (draft ids are verified as
    target ids)."""
    if settings.start == "fresh":
        config = AutoConfig.from_pretrained(target_dir)
        for key, value in settings.fresh_config.items():
            if key == "vocab_size" or not hasattr(config, key):
                raise UserError(f"draft.fresh_config.{key}: not a setting of the target's {config.model_type} config")
            setattr(config, key, value)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if settings.start == "target_layers":
        model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
        n = model.config.num_hidden_layers
        if max(settings.layers) >= n:
            raise UserError(f"draft.layers {settings.layers}: the target has {n} layers")
        model.model.layers = nn.ModuleList(model.model.layers[i] for i in settings.layers)
        model.config.num_hidden_layers = len(settings.layers)
        return model
    mine, theirs = AutoTokenizer.from_pretrained(settings.start), AutoTokenizer.from_pretrained(target_dir)
    if mine.get_vocab() != theirs.get_vocab():
        raise UserError(f"draft.start {settings.start!r}: its tokenizer is not the target's")
    return AutoModelForCausalLM.from_pretrained(settings.start, dtype=torch.float32)


class DraftModelFamily(Family):
    name = "draft_model"
    settings = Settings
    title = "draft model"
    step_label = "step"
    columns = ("loss", "full_acc", "cond_acc")
    draft_type = StandaloneDraft
    config_type = DraftModelConfig

    def config_from_dict(self, saved: dict[str, Any]) -> DraftModelConfig:
        return checked_config(saved)

    def new_draft(
        self,
        settings: Settings,
        target_config: Any,
        head: dict[str, torch.Tensor],
        token_freq: torch.Tensor,
        aux_layer_ids: list[int],
    ) -> StandaloneDraft:
        """A copy of the starting LM with its own (untied) output layer; the vocabulary is the target's whole one."""
        start = starting_model(settings, target_config._name_or_path)
        vocab = target_config.get_text_config().vocab_size
        if start.config.vocab_size != vocab:
            raise UserError(f"draft.start: {start.config.vocab_size} ids, the target has {vocab}")
        draft = StandaloneDraft(DraftModelConfig(model_config(start.config), target_vocab_size=vocab))
        state = start.state_dict()
        state["lm_head.weight"] = start.get_output_embeddings().weight.detach().clone()
        draft.lm.load_state_dict(state)
        return draft

    def states(self, config: DraftModelConfig) -> StateSpec:
        return NO_STATES

    def attach_target(self, draft: StandaloneDraft, embed_weight: torch.Tensor, has_embedding: bool) -> None:
        """A standalone draft owns its embedding."""

    def objective(
        self,
        draft: StandaloneDraft,
        head: TargetHead,
        settings: Settings,
        depth: int | None = None,
        divergence: str | None = None,
    ) -> DraftModelObjective:
        return DraftModelObjective(draft, head, divergence or settings.loss)

    def proposer(self, draft: StandaloneDraft, target: Target) -> DraftModelProposer:
        return DraftModelProposer(draft)

    def card_rows(self, draft: StandaloneDraft, fmt: str, k: int) -> list[tuple[str, str]]:
        cfg = draft.config.llama
        return [
            ("target states read", "none: it reads tokens, with its own KV cache"),
            ("layers / hidden size", f"{cfg.num_hidden_layers} / {cfg.hidden_size}"),
            ("vocabulary", f"the target's {cfg.vocab_size} ids"),
            ("speculative tokens", str(k)),
        ]


FAMILY = DraftModelFamily()
