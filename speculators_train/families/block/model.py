"""DFlash draft (arXiv 2602.06036; speculators' DFlashDraftModel, vLLM's `method: dflash`): a block of draft tokens
from one forward over [anchor, mask x (B - 1)], conditioned on the target's states injected as keys and values.

    c_t      = hidden_norm(fc(concat(aux_t)))                  the target's states at position t, fused  [.., H]
    layer l  keys/values of the context: k_norm(k_proj_l(c_t)), v_proj_l(c_t) at RoPE position t (no input norm)
             a block anchored at a: slot i holds embed(x_a) (i = 0) or embed(mask_token_id), at position a + i;
             its queries see every context key at t < a and every slot of their own block (bidirectional), and
             run through the Qwen3 layer (input norm, q/k norms, MLP) as usual
    logits   = lm_head(norm(h)) of slots 1..B-1                 slot i proposes x_{a+i}

The anchor is the token the target just produced (the bonus token), so slot 0 proposes nothing: B - 1 draft tokens
per forward (speculators' `sample_from_anchor: false`). The embedding is the target's, frozen; the mask slots read
the target's own row of `mask_token_id`, as vLLM embeds them.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
    rotate_half,
)

from speculators_train.architectures import text_config
from speculators_train.families.block.settings import MAX_BLOCK, MAX_DRAFT_LAYERS
from speculators_train.families.draft_config import (
    Bounded,
    Hidden,
    LayerIds,
    Vocab,
    checked,
    draft_config,
    spelled,
    within,
)
from speculators_train.families.eagle.model import checked_config
from speculators_train.families.format_common import MAX_LAYERS, MAX_VOCAB, decoder_layers_like
from speculators_train.families.vocab import first_ids

KV = tuple[torch.Tensor, torch.Tensor]


@draft_config
class DFlashConfig:
    """Everything needed to rebuild the draft; saved as JSON beside its weights."""

    layer_config: dict[str, Any]  # a Qwen3Config dict of the decoder layers (num_hidden_layers: the draft's)
    target_hidden_size: Hidden
    draft_vocab_size: Vocab  # at most target_vocab_size (`checked_dflash_config`)
    aux_layer_ids: LayerIds
    block_size: Bounded(2, MAX_BLOCK)
    mask_token_id: Bounded(0, MAX_VOCAB - 1)  # a target id (`checked_dflash_config`)
    target_vocab_size: Bounded(0, MAX_VOCAB) = 0  # 0: the layer's vocab_size
    target_num_layers: Bounded(0, MAX_LAYERS) = 0  # the target's decoder layer count (0: unknown)

    def __post_init__(self) -> None:
        if not self.target_vocab_size:
            self.target_vocab_size = self.layer_config["vocab_size"]

    @property
    def qwen3(self) -> Qwen3Config:
        return Qwen3Config(**self.layer_config)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def for_target(
        cls,
        target_config: Any,
        aux_layer_ids: list[int],
        draft_vocab_size: int,
        block_size: int,
        num_layers: int,
        mask_token_id: int,
    ) -> DFlashConfig:
        """Qwen3 decoder layers shaped like the target's (hidden size, heads, MLP width, RoPE), as speculators builds
        a DFlash draft for any verifier."""
        text = text_config(target_config)
        return cls(
            decoder_layers_like(Qwen3Config, target_config, num_layers),
            text.hidden_size,
            draft_vocab_size,
            list(aux_layer_ids),
            block_size,
            mask_token_id,
            target_num_layers=text.num_hidden_layers,
        )


class DFlashLayers(BaseModel):
    """The decoder-layer keys a DFlash draft adds to a Qwen3 layer config (the rest is `eagle.LlamaLayer`'s)."""

    model_config = ConfigDict(extra="allow")

    num_hidden_layers: Bounded(1, MAX_DRAFT_LAYERS) = 1
    layer_types: list[Literal["full_attention"]] | None = None  # sliding-window draft layers are not built here


def checked_dflash_config(
    values: dict[str, Any], keys: dict[str, str] | None = None, config_type: type[DFlashConfig] = DFlashConfig
) -> DFlashConfig:
    """A `config_type` from a file's values, each typed and in range first (ValueError names the key as the file
    spells it: `keys` maps a field to that spelling where it differs)."""
    name = spelled(keys)
    layer = values.get("layer_config")
    if isinstance(layer, dict):
        checked(DFlashLayers, layer, prefix=f"{name('layer_config')}.")
    config = checked_config(values, keys, config_type)
    within(config.mask_token_id, 0, config.target_vocab_size - 1, name("mask_token_id"))
    return config


def block_attention(
    q: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    kb: torch.Tensor,
    vb: torch.Tensor,
    visible: torch.Tensor | None,
) -> torch.Tensor:
    """Each block's queries over the context keys they may see and over their own block's keys, one softmax.

    q, kb, vb: [B, heads, n, S, d] (n blocks of S slots, q already scaled); kc, vc: [B, heads, L, d];
    visible: [B, n, L] (the context positions before each block's anchor), None: all of them."""
    context = torch.einsum("bhnsd,bhld->bhnsl", q, kc)
    if visible is not None:
        context = context.masked_fill(~visible[:, None, :, None, :], float("-inf"))
    own = q @ kb.transpose(-1, -2)  # [B, heads, n, S, S]
    softmax_dtype = torch.promote_types(q.dtype, torch.float32)
    probs = torch.softmax(torch.cat([context, own], dim=-1), dim=-1, dtype=softmax_dtype).to(q.dtype)
    length = kc.shape[-2]
    return torch.einsum("bhnsl,bhld->bhnsd", probs[..., :length], vc) + probs[..., length:] @ vb


class DFlashAttention(nn.Module):
    """Qwen3 attention's weights (q/k/v/o projections, per-head q/k RMS norms), as speculators names them."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        hidden, bias = config.hidden_size, config.attention_bias
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim or hidden // self.heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def heads_of(self, x: torch.Tensor, proj: nn.Linear, norm: nn.Module | None) -> torch.Tensor:
        """[B, T, H] -> [B, heads, T, d] through `proj` and the per-head `norm`."""
        out = proj(x).view(*x.shape[:-1], -1, self.head_dim)
        return (out if norm is None else norm(out)).transpose(1, 2)


class DFlashLayer(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    # Around each sublayer a layer may transform the block's slots (DFlash2's convolutions): `before_*` takes the
    # normed input [B, n, S, H] and returns it with what `around_*` needs for the sublayer's output.
    def before_attention(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return x, None

    def around_attention(self, out: torch.Tensor, saved: Any) -> torch.Tensor:
        return out

    def before_mlp(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return x, None

    def around_mlp(self, out: torch.Tensor, saved: Any) -> torch.Tensor:
        return out

    def context_kv(self, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> KV:
        """This layer's keys and values of the fused context [B, L, H] at its positions' RoPE: [B, kv heads, L, d]."""
        attn = self.self_attn
        k = attn.heads_of(context, attn.k_proj, attn.k_norm)
        k = k * cos[:, None] + rotate_half(k) * sin[:, None]
        return k, attn.heads_of(context, attn.v_proj, None)

    def forward(
        self,
        h: torch.Tensor,
        k_context: torch.Tensor,
        v_context: torch.Tensor,
        visible: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """h [B, n, S, H] (n blocks of S slots); cos/sin at the slots' positions [B, n*S, d]."""
        attn = self.self_attn
        batch, n, size, hidden = h.shape
        x, x_kernel = self.before_attention(self.input_layernorm(h))
        x = x.reshape(batch, n * size, hidden)
        q = attn.heads_of(x, attn.q_proj, attn.q_norm)
        k = attn.heads_of(x, attn.k_proj, attn.k_norm)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        v = attn.heads_of(x, attn.v_proj, None)
        groups = attn.heads // attn.kv_heads
        blocks = (batch, attn.heads, n, size, attn.head_dim)
        out = block_attention(
            (q * attn.scaling).reshape(blocks),
            repeat_kv(k_context, groups),
            repeat_kv(v_context, groups),
            repeat_kv(k, groups).reshape(blocks),
            repeat_kv(v, groups).reshape(blocks),
            visible,
        )
        h = h + self.around_attention(attn.o_proj(out.permute(0, 2, 3, 1, 4).reshape(batch, n, size, -1)), x_kernel)
        x, kernel = self.before_mlp(self.post_attention_layernorm(h))
        return h + self.around_mlp(self.mlp(x), kernel)


class DFlashDraft(nn.Module):
    """Weight names follow speculators' DFlashDraftModel (`fc`, `hidden_norm`, `layers.N.*`, `norm`, `lm_head`,
    `d2t`, `t2d`); `embed_tokens` is the target's and is not saved."""

    first_slot: ClassVar[int] = 1  # the first slot that proposes (the anchor, the bonus token, proposes nothing)

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        qwen3 = config.qwen3
        hidden = qwen3.hidden_size
        self.fc = nn.Linear(len(config.aux_layer_ids) * config.target_hidden_size, hidden, bias=False)
        self.hidden_norm = Qwen3RMSNorm(hidden, eps=qwen3.rms_norm_eps)
        self.layers = nn.ModuleList([self.make_layer(config) for _ in range(qwen3.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(hidden, eps=qwen3.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(config.target_vocab_size, hidden)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        if config.draft_vocab_size == config.target_vocab_size:
            # Over the whole vocabulary speculators and llama.cpp run the target's own head, not the file's: it
            # stays the target's (`new_draft` copies it) and is not trained.
            self.lm_head.weight.requires_grad_(False)
        self.rotary_emb = Qwen3RotaryEmbedding(qwen3)
        d2t, t2d = first_ids(config.draft_vocab_size, config.target_vocab_size)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)
        self.gradient_checkpointing = False

    def make_layer(self, config: DFlashConfig) -> DFlashLayer:
        """One decoder layer of the draft (a family whose layers differ builds its own)."""
        return DFlashLayer(config.qwen3)

    def context(self, aux: torch.Tensor, positions: torch.Tensor) -> list[KV]:
        """Every layer's keys and values of the target's states aux [B, L, A*H_target] at `positions` [B, L]."""
        fused = self.hidden_norm(self.fc(aux))
        cos, sin = self.rotary_emb(fused, positions)
        return [layer.context_kv(fused, cos, sin) for layer in self.layers]

    def blocks(
        self,
        anchor_tokens: torch.Tensor,
        anchor_positions: torch.Tensor,
        size: int,
        context: list[KV],
        visible: torch.Tensor | None,
        proposing: int | None = None,
        logits: bool = True,
    ) -> torch.Tensor:
        """Draft-vocab logits [B, n, P, D] of the first P = `proposing` (default: all) proposing slots of n blocks
        of `size` slots: anchors [B, n] (tokens and positions), every layer's context keys from `context`, seen where
        `visible` [B, n, L] (None: all). Slots before `first_slot` propose nothing and get no logits. Without
        `logits`: the slots' outputs through the final norm [B, n, P, H] (a loss applies `slot_logits` by chunks)."""
        batch, n = anchor_tokens.shape
        ids = torch.full((batch, n, size), self.config.mask_token_id, device=anchor_tokens.device)
        ids[..., 0] = anchor_tokens
        h = self.embed_tokens(ids).to(self.fc.weight.dtype)
        positions = anchor_positions[..., None] + torch.arange(size, device=anchor_positions.device)
        cos, sin = self.rotary_emb(h, positions.reshape(batch, n * size))
        for layer, (k, v) in zip(self.layers, context, strict=True):
            if self.gradient_checkpointing and self.training:
                h = checkpoint(layer, h, k, v, visible, cos, sin, use_reentrant=False)
            else:
                h = layer(h, k, v, visible, cos, sin)
        first = self.first_slot
        normed = self.norm(h[:, :, first : first + (proposing or size - first)])
        return self.lm_head(normed) if logits else normed

    def slot_logits(self, normed: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits of proposing slots' outputs `normed` [..., P, H]; `previous` [..., P] (target ids: the
        token before each slot's own) is read by drafts whose slots depend on it (DSpark)."""
        return self.lm_head(normed)

    def selector_logits(
        self, normed: torch.Tensor, previous: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A candidate selector's training scores [..., k] over each slot's top-k with `targets` [...] injected
        where missing, and the target's rank among them [...]; None: the draft has no selector."""
        return None

    @property
    def selects_candidates(self) -> bool:
        """Whether `selector_logits` reranks each slot's candidates (a candidate selector)."""
        return False

    @property
    def predicts_acceptance(self) -> bool:
        """Whether `confidence_logits` predicts each slot's acceptance (a confidence head)."""
        return False

    def confidence_logits(self, normed: torch.Tensor, previous: torch.Tensor) -> torch.Tensor | None:
        """Each slot's predicted acceptance, as a logit [..., P]; None: the draft predicts none."""
        return None

    def training_forward(
        self,
        tokens: torch.Tensor,
        aux: torch.Tensor,
        anchors: torch.Tensor,
        proposing: int | None = None,
        logits: bool = True,
    ) -> torch.Tensor:
        """Logits [B, n, P, D] of the first P mask slots (default: all) of the blocks anchored at `anchors` [B, n]
        of sequences `tokens` [B, L] whose target states are `aux` [B, L, A*H_target] (state t at position t): each
        block sees the states before its anchor, as at inference after the target has verified up to the anchor."""
        length = tokens.shape[1]
        positions = torch.arange(length, device=tokens.device).expand(tokens.shape[0], -1)
        visible = positions[:, None, :] < anchors[:, :, None]
        context = self.context(aux, positions)
        size = self.config.block_size
        return self.blocks(tokens.gather(1, anchors), anchors, size, context, visible, proposing, logits)
