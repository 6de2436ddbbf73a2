"""The standalone draft model as a registered family: a small causal LM with the target's tokenizer, started from
some of the target's layers or from a smaller model, distilled from the target's distribution, served by engines
as a plain model folder."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from speculators_train.architectures import model_class, text_config, text_decoder
from speculators_train.errors import UserError
from speculators_train.families.base import DraftStart, Family
from speculators_train.families.draft_model.model import DraftModelConfig, StandaloneDraft, checked_config, model_config
from speculators_train.families.draft_model.objective import DraftModelObjective
from speculators_train.families.draft_model.proposer import DraftModelProposer
from speculators_train.families.draft_model.settings import Settings
from speculators_train.folders import check_model_folder
from speculators_train.head import TargetHead
from speculators_train.loading import describe, reading
from speculators_train.target import NO_STATES, StateSpec


def starting_model(settings: Settings, start: DraftStart) -> nn.Module:
    """The LM a new draft copies: the target's text decoder cut to `settings.layers`, a random model of the
    target's text architecture (`fresh`), or the model `settings.start` names, whose tokenizer must be the target's
    (draft ids are verified as target ids). The first two are of the target's own model type and layer types."""
    target_config = start.target_config
    if settings.start == "fresh":
        config = copy.deepcopy(text_config(target_config))
        for key, value in settings.fresh_config.items():
            if key == "vocab_size" or not hasattr(config, key):
                raise UserError(f"draft.fresh_config.{key}: not a setting of the target's {config.model_type} config")
            setattr(config, key, value)
        # the target's pattern of layer types, cycled over a draft deeper than the target
        pattern = [i % text_config(target_config).num_hidden_layers for i in range(config.num_hidden_layers)]
        config = cut_layers(text_config(target_config), pattern, config)
        return AutoModelForCausalLM.from_config(_causal(config), dtype=torch.float32)
    if settings.start == "target_layers":
        return target_layers(target_config, start.target_dir, settings.layers)
    check_model_folder(settings.start, "draft.start")
    with reading(settings.start, "draft.start"):
        mine = AutoTokenizer.from_pretrained(settings.start, trust_remote_code=False)
        theirs = AutoTokenizer.from_pretrained(start.target_dir, trust_remote_code=False)
        if mine.get_vocab() != theirs.get_vocab():
            raise UserError(f"draft.start {settings.start!r}: its tokenizer is not the target's")
        return AutoModelForCausalLM.from_pretrained(
            settings.start, dtype=torch.float32, use_safetensors=True, trust_remote_code=False
        )


def cut_layers(text: Any, keep: list[int], config: Any = None) -> Any:
    """A copy of `config` (default: the text config `text`) for a model of `text`'s layers `keep`, in order: every
    per-layer list (`layer_types` and its kin) cut to those layers, every list of layer ids renumbered."""
    n = text.num_hidden_layers
    out = copy.deepcopy(config if config is not None else text)
    for key, value in text.to_dict().items():
        if not isinstance(value, list) or key.endswith("_token_id") or key == "architectures":
            continue
        # A list of layer ids (Llama-4's `moe_layers`) is strictly increasing, even when it names every layer; a
        # per-layer list of ints (its `no_rope_layers` flags) is not.
        ids = all(isinstance(v, int) and 0 <= v < n for v in value) and value == sorted(set(value))
        if key.endswith("layers") and ids:
            setattr(out, key, [keep.index(v) for v in value if v in keep])
        elif len(value) == n and key != "rope_parameters":
            setattr(out, key, [value[i] for i in keep])
    out.num_hidden_layers = len(keep)
    return out


def _causal(config: Any) -> Any:
    """`config` if transformers has a causal LM of its type, else a refusal naming the type."""
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(
            f"the target's text decoder ({type(config).__name__}) has no causal-LM class in transformers, so a "
            "draft of its own architecture cannot be built (nor served by an engine as a draft model): set "
            "draft.start to a small causal LM with the target's tokenizer (e.g. Qwen2.5-0.5B-Instruct for "
            "Qwen2.5-VL)"
        )
    return config


def target_layers(target_config: Any, target_dir: Path, keep: list[int]) -> nn.Module:
    """A causal LM of the target's text architecture holding the target's layers `keep`, its embedding, final norm
    and lm_head (from the safetensors in `target_dir`, a multimodal wrapper's language model included)."""
    text = text_config(target_config)
    if max(keep) >= text.num_hidden_layers:
        raise UserError(f"draft.layers {keep}: the target has {text.num_hidden_layers} layers")
    config = _causal(cut_layers(text, keep))
    source = model_class(target_config).from_pretrained(
        target_dir, config=target_config, dtype=torch.float32, use_safetensors=True
    )
    decoder = text_decoder(source)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    into = text_decoder(model)
    state = {}
    for name, tensor in decoder.state_dict().items():
        if name.startswith("layers."):
            index, rest = name[len("layers.") :].split(".", 1)
            if int(index) not in keep:
                continue
            name = f"layers.{keep.index(int(index))}.{rest}"
        state[name] = tensor
    try:
        into.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise UserError(
            f"draft.layers {keep}: a {config.model_type} model of those layers does not hold their weights (the "
            f"target mixes layer structures, e.g. dense and MoE layers, that the cut config describes otherwise): "
            f"{describe(exc)}"
        ) from None
    with torch.no_grad():
        model.get_output_embeddings().weight.copy_(source.get_output_embeddings().weight)
    return model


class DraftModelFamily(Family):
    name = "draft_model"
    settings = Settings
    title = "draft model"
    step_label = "step"
    draft_type = StandaloneDraft
    config_type = DraftModelConfig
    config_reader = staticmethod(checked_config)
    proposer_type = DraftModelProposer

    def new_draft(self, settings: Settings, start: DraftStart) -> StandaloneDraft:
        """A copy of the starting LM with its own (untied) output layer; the vocabulary is the target's whole one."""
        vocab = text_config(start.target_config).vocab_size
        lm = starting_model(settings, start)
        if lm.config.vocab_size != vocab:
            raise UserError(f"draft.start: {lm.config.vocab_size} ids, the target has {vocab}")
        draft = StandaloneDraft(DraftModelConfig(model_config(lm.config), target_vocab_size=vocab))
        state = lm.state_dict()
        state["lm_head.weight"] = lm.get_output_embeddings().weight.detach().clone()
        draft.lm.load_state_dict(state)
        return draft

    def states(self, config: DraftModelConfig) -> StateSpec:
        """None: it reads tokens alone (the final state it trains on only gives the target's distribution)."""
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

    def card_rows(self, draft: StandaloneDraft, fmt: str, k: int) -> list[tuple[str, str]]:
        cfg = draft.config.lm_config
        return [
            ("architecture", f"{type(draft.lm).__name__} ({cfg.model_type})"),
            ("target states read", "none: it reads tokens, with its own KV cache"),
            ("layers / hidden size", f"{cfg.num_hidden_layers} / {cfg.hidden_size}"),
            ("vocabulary", f"the target's {cfg.vocab_size} ids"),
            ("speculative tokens", str(k)),
        ]


FAMILY = DraftModelFamily()
