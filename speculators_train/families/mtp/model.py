"""An MTP head (DeepSeek-V3's multi-token prediction module, as vLLM's `method: mtp` runs it for DeepSeek, GLM-4.5
and MiMo targets): one decoder layer of the target's own class, fed the target's state and the next token.

    position p (the target state's position), step 0:
        x   = eh_proj([enorm(e); hnorm(h_p)])      h_p: the target's post-norm last state after x_p
                                                   e:   embed(x_{p+1}), zero at p = 0 (style deepseek)
        g_0 = block(x) at position p                the target's decoder layer class at index n (its MTP slot),
                                                   its residual included: the layer's pre-norm output
        logits = head(shared_norm(g_0))             proposes x_{p+2}; embed and head are the target's, frozen
    step k > 0: h = g_{k-1} (style deepseek) or shared_norm(g_{k-1}) (qwen3_next), e = embed(x_{p+k+1}) at p + k

Training runs each step as one causal pass over the sequence (FastMTP, speculators' MTP), each step's keys from its
own inputs; the loop keeps one key/value cache of the verified positions' step-0 inputs, as vLLM does.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import asdict
from typing import Any

import torch
from pydantic import StrictBool
from torch import nn
from transformers import AutoConfig
from transformers.masking_utils import create_causal_mask

from speculators_train.architectures import final_norm, text_decoder
from speculators_train.families.draft_config import Bounded, checked, draft_config, spelled
from speculators_train.families.format_common import MAX_LAYERS
from speculators_train.families.mtp.settings import MAX_STEPS, Style
from speculators_train.head import meta_model


@draft_config
class MTPConfig:
    """Everything needed to rebuild the head; saved as JSON beside its weights."""

    layer_config: dict[str, Any]  # the target's text config (its decoder layer's class and sizes)
    num_steps: Bounded(1, MAX_STEPS) = 3  # steps trained recursively (FastMTP: 3)
    target_num_layers: Bounded(1, MAX_LAYERS) = 1
    from_target: StrictBool = False  # started from the target's own MTP weights
    style: Style = "deepseek"  # how the engine runs it (settings.py)

    @property
    def text(self) -> Any:
        values = dict(self.layer_config)
        return AutoConfig.for_model(values.pop("model_type"), **values)

    @property
    def target_hidden_size(self) -> int:
        return int(self.layer_config["hidden_size"])

    @property
    def target_vocab_size(self) -> int:
        return int(self.layer_config["vocab_size"])

    @property
    def draft_vocab_size(self) -> int:
        return self.target_vocab_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def checked_mtp_config(values: dict[str, Any], keys: dict[str, str] | None = None) -> MTPConfig:
    config = checked(MTPConfig, values, keys)
    name = spelled(keys)
    for field in ("model_type", "hidden_size", "vocab_size", "num_hidden_layers"):
        if field not in config.layer_config:
            raise ValueError(f"{name('layer_config')} has no {field}")
    return config


def per_layer_lists(config: Any) -> list[str]:
    """The config's lists with one entry per decoder layer (`layer_types`, `mlp_layer_types`, Llama-4's
    `no_rope_layers`, ...), whatever the architecture names them."""
    n = config.num_hidden_layers
    return [k for k, v in vars(config).items() if isinstance(v, list) and len(v) == n and not k.startswith("_")]


def mtp_layer_config(text: Any) -> Any:
    """The target's text config with one more layer, the MTP slot at index n: full attention, and otherwise of the
    kind of the target's last layer in every per-layer list; the class the target builds there is the MTP block's
    (DeepSeek and GLM build a MoE layer past `first_k_dense_replace`)."""
    config = copy.deepcopy(text)
    for name in per_layer_lists(text):
        values = getattr(text, name)
        setattr(config, name, [*values, "full_attention" if name == "layer_types" else values[-1]])
    config.num_hidden_layers = text.num_hidden_layers + 1
    return config


def block_problem(text: Any) -> str | None:
    """Why the layer the target's class builds at the MTP slot cannot be the head's block (None: it can): the head
    runs it with self-attention over a cache of its own and the decoder's rotary positions (a hybrid Mamba block,
    Nemotron-H's, has a `mixer` and no rotary embedding)."""
    try:
        decoder = text_decoder(meta_model(mtp_layer_config(text)))
    except Exception:  # a decoder this cannot build: building the head says why, in its own words
        return None
    block = decoder.layers[-1]
    missing = [name for name, owner in (("self_attn", block), ("rotary_emb", decoder)) if not hasattr(owner, name)]
    if not missing:
        return None
    return (
        f"draft.family 'mtp': the head is one decoder layer of the target's class with self-attention and rotary "
        f"positions; the target's {type(block).__name__} at that slot and its decoder have no {' or '.join(missing)}"
    )


class MTPDraft(nn.Module):
    def __init__(self, config: MTPConfig) -> None:
        super().__init__()
        self.config = config
        meta = meta_model(mtp_layer_config(config.text))
        text = meta.config.get_text_config()  # with the attention kernel transformers picks for the class
        self.layer_text = text
        decoder = text_decoder(meta)
        slot = text.num_hidden_layers - 1
        hidden = text.hidden_size
        self.block = type(decoder.layers[slot])(text, layer_idx=slot)
        self.block.apply(meta._init_weights)  # the target's own initialisation (fused experts are left empty)
        self.block.self_attn.layer_idx = 0  # the only layer of the head's own cache
        self.rotary_emb = type(decoder.rotary_emb)(config=text)
        # Gemma-3's rotary tables are per layer kind: the slot's (full attention)
        kinds = "layer_type" in inspect.signature(self.rotary_emb.forward).parameters
        self.rope_kind = {"layer_type": text.layer_types[slot]} if kinds else {}
        self.enorm, self.hnorm, self.shared_norm = (self.norm_like(final_norm(decoder)) for _ in range(3))
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.embed_tokens = nn.Embedding(text.vocab_size, hidden)
        self.lm_head = nn.Linear(hidden, text.vocab_size, bias=False)
        self.embed_tokens.requires_grad_(False)
        self.lm_head.requires_grad_(False)

    @staticmethod
    def norm_like(norm: nn.Module) -> nn.Module:
        """A norm of the target's class (RMSNorm, Gemma's 1 + w), weights set when the head is started or read."""
        out = copy.deepcopy(norm).to_empty(device="cpu")
        with torch.no_grad():
            for p in out.parameters():
                p.fill_(1.0)
        return out

    def step(
        self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, cache: Any = None
    ) -> torch.Tensor:
        """One step over [B, L] positions: `hidden` [B, L, H] (the target's post-norm state or the step before's
        `carry`), `tokens` [B, L] the token after each position; the block's pre-norm output [B, L, H]."""
        embeds = self.embed_tokens(tokens)
        if self.config.style == "deepseek":
            embeds = embeds * (positions != 0)[..., None].to(hidden.dtype)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        mask = create_causal_mask(
            config=self.layer_text, inputs_embeds=x, attention_mask=None, past_key_values=cache, position_ids=positions
        )
        out = self.block(
            x,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=cache is not None,
            position_embeddings=self.rotary_emb(x, positions, **self.rope_kind),
        )
        return out[0] if isinstance(out, tuple) else out

    def carry(self, out: torch.Tensor) -> torch.Tensor:
        """What the next step reads of this step's block output (`Style`)."""
        return out if self.config.style == "deepseek" else self.shared_norm(out)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.shared_norm(out))
