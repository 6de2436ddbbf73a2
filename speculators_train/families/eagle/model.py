"""EAGLE-3 draft: fused target states + one Llama decoder layer over [embedding ; hidden].

    h0   = fc(concat(aux_low, aux_mid, aux_high))                      [B, T, H]
    x    = concat(input_layernorm(embed(tok)), hidden_norm(h))         [B, T, 2H]  (embedding first)
    out  = h + o_proj(attn(q(x), k(x), v(x)))                          residual is the hidden only
    out  = out + mlp(post_attention_layernorm(out))                    pre-norm output, fed back as next h
    logits = lm_head(norm(out))                                        over the reduced draft vocab

EAGLE-3.1's two switches (speculators' names, which vLLM and llama.cpp's converter read):
    norm_before_fc   h0 = fc(input_norm(concat(aux)))    one RMSNorm over the 3 x H_target concatenation, which
                     tames targets with huge outlier channels in the residual stream (SmolLM2 has them)
    norm_output      norm(out) is fed back as the next step's h instead of out (logits are unchanged)

Training-time test (TTT) unrolls the layer `steps` times: tokens stay teacher-forced, the hidden input
of step i is step i-1's output. Keys of step 0 are attended causally; keys of steps 1..i only at the
query's own position (the draft token it produced there). RoPE position of step i is pos + i.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, StrictStr
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)

from speculators_train.architectures import text_config
from speculators_train.families.draft_config import (
    Bounded,
    Hidden,
    LayerIds,
    PositiveNumber,
    Vocab,
    checked,
    draft_config,
    spelled,
    within,
)
from speculators_train.families.format_common import (
    MAX_INTERMEDIATE,
    MAX_LAYERS,
    MAX_VOCAB,
    decoder_layers_like,
    shown,
)
from speculators_train.families.vocab import first_ids
from speculators_train.folders import config_problem

KV = tuple[torch.Tensor, torch.Tensor]

# The target's embedding (target vocab x hidden) is the one tensor a loaded draft builds beyond what its files
# carry; 2**32 elements (16 GiB in fp32) is twice Llama-3.1-405B's.
MAX_EMBEDDING = 1 << 32
MAX_POSITIONS = 1 << 24


@draft_config
class Eagle3Config:
    """Everything needed to rebuild the draft; saved as JSON beside its weights."""

    layer_config: dict[str, Any]  # a LlamaConfig dict for the single decoder layer (num_hidden_layers: 1)
    target_hidden_size: Hidden
    draft_vocab_size: Vocab  # at most target_vocab_size (`checked_config`)
    aux_layer_ids: LayerIds
    norm_before_residual: StrictBool = False
    target_vocab_size: Bounded(0, MAX_VOCAB) = 0  # 0: the layer's vocab_size
    target_num_layers: Bounded(0, MAX_LAYERS) = 0  # the target's decoder layer count (0: unknown, e.g. imported)
    norm_before_fc: StrictBool = False
    norm_output: StrictBool = False

    def __post_init__(self) -> None:
        if not self.target_vocab_size:
            self.target_vocab_size = self.layer_config["vocab_size"]

    @property
    def llama(self) -> LlamaConfig:
        return LlamaConfig(**self.layer_config)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def for_target(
        cls,
        target_config,
        aux_layer_ids: list[int],
        draft_vocab_size: int,
        norm_before_residual: bool,
        norm_before_fc: bool = False,
        norm_output: bool = False,
    ) -> Eagle3Config:
        """One Llama decoder layer shaped like the target's (hidden size, heads, MLP width, RoPE), whatever the
        target's own layers are: the layer vLLM, SGLang and llama.cpp build an EAGLE-3 draft of."""
        text = text_config(target_config)
        return cls(
            decoder_layers_like(LlamaConfig, target_config, 1),
            text.hidden_size,
            draft_vocab_size,
            list(aux_layer_ids),
            norm_before_residual,
            target_num_layers=text.num_hidden_layers,
            norm_before_fc=norm_before_fc,
            norm_output=norm_output,
        )


class LlamaLayer(BaseModel):
    """The LlamaConfig values a draft's decoder layers are built from, typed and in range; its other keys reach
    LlamaConfig as they are. Head counts are bounded by the width (`check_layer`)."""

    model_config = ConfigDict(extra="allow")

    hidden_size: Hidden
    intermediate_size: Bounded(1, MAX_INTERMEDIATE)
    vocab_size: Vocab
    num_attention_heads: StrictInt
    num_key_value_heads: StrictInt | None = None
    head_dim: Hidden | None = None
    rms_norm_eps: PositiveNumber | None = None
    max_position_embeddings: Bounded(1, MAX_POSITIONS) | None = None
    hidden_act: StrictStr = "silu"
    attention_bias: StrictBool = False
    mlp_bias: StrictBool = False


def check_layer(layer: dict[str, Any], prefix: str = "") -> None:
    """`layer` (a LlamaConfig dict) as `LlamaLayer` reads it, with the head layout it implies; ValueError names the
    key as `prefix` + key (its path in the file). Its RoPE theta and scaling factors must be finite and above 0
    (`folders.config_problem`): a zero theta loads and runs with every logit NaN."""
    values = checked(LlamaLayer, layer, prefix=prefix)
    hidden = values.hidden_size
    heads = within(values.num_attention_heads, 1, hidden, f"{prefix}num_attention_heads")
    kv = within(values.num_key_value_heads or heads, 1, heads, f"{prefix}num_key_value_heads")
    if heads % kv:  # each key/value head serves a whole group of query heads
        raise ValueError(f"{prefix}num_key_value_heads {kv} must divide {prefix}num_attention_heads {heads}")
    head_dim = values.head_dim
    if head_dim is None:  # LlamaConfig's default: hidden split evenly over the heads
        if hidden % heads:
            raise ValueError(
                f"{prefix}num_attention_heads {heads} must divide {prefix}hidden_size {hidden} (no head_dim given)"
            )
        head_dim = hidden // heads
    if head_dim % 2:
        raise ValueError(
            f"{prefix}head_dim {head_dim} (or hidden_size / num_attention_heads) is odd; RoPE rotates pairs"
        )
    if values.hidden_act not in ACT2FN:
        raise ValueError(f"{prefix}hidden_act {shown(values.hidden_act)} is not an activation transformers knows")
    problem = config_problem(layer, prefix)  # what LlamaLayer leaves untyped: RoPE theta and scaling factors
    if problem:
        raise ValueError(problem)


def checked_config(
    values: dict[str, Any], keys: dict[str, str] | None = None, config_type: type[Eagle3Config] = Eagle3Config
) -> Eagle3Config:
    """A `config_type` from `values` (its fields, as read from a file), each typed and in range first. ValueError
    names a field as the file spells it: `keys` maps a field to that spelling where it differs (export formats)."""
    name = spelled(keys)
    layer = values.get("layer_config")
    if isinstance(layer, dict):  # its own keys first: the fields below default to its values
        check_layer(layer, f"{name('layer_config')}." if name("layer_config") else "")
        # missing: the target is as wide as the draft's layer
        values = {"target_hidden_size": layer["hidden_size"], **{k: v for k, v in values.items() if v is not None}}
    config = checked(config_type, values, keys)
    target_vocab, hidden = config.target_vocab_size, config.layer_config["hidden_size"]
    if target_vocab * hidden > MAX_EMBEDDING:
        raise ValueError(
            f"the target embedding it describes ({target_vocab} ids x {hidden}) exceeds {MAX_EMBEDDING} elements"
        )
    within(config.draft_vocab_size, 1, target_vocab, name("draft_vocab_size"))
    return config


def ttt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: list[KV], scale: float) -> torch.Tensor:
    """Attention of step len(past): causal over step-0 keys, plus same-position keys of later steps.

    q: [B, nh, T, d]; k, v: [B, nh, T, d] (already GQA-repeated); past: earlier steps' (k, v).
    """
    if not past:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    k0, v0 = past[0]
    extra_k = [kv[0] for kv in past[1:]] + [k]
    extra_v = [kv[1] for kv in past[1:]] + [v]
    t = q.shape[-2]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores0 = (q @ k0.transpose(-1, -2)) * scale  # [B, nh, T, T]
    scores0 = scores0.masked_fill(~causal, float("-inf"))
    diag = torch.stack([(q * ks).sum(-1) for ks in extra_k], dim=-1) * scale  # [B, nh, T, steps]
    softmax_dtype = torch.promote_types(q.dtype, torch.float32)  # fp32 at least, never below the input
    probs = torch.softmax(torch.cat([scores0, diag], dim=-1), dim=-1, dtype=softmax_dtype).to(q.dtype)
    out = probs[..., :t] @ v0
    for s, vs in enumerate(extra_v):
        out = out + probs[..., t + s, None] * vs
    return out


class Eagle3Layer(nn.Module):
    """The draft's decoder layer: Llama attention/MLP/norms, with q/k/v reading 2H inputs."""

    def __init__(self, config: LlamaConfig, norm_before_residual: bool) -> None:
        super().__init__()
        h = config.hidden_size
        self.norm_before_residual = norm_before_residual
        self.self_attn = LlamaAttention(config, layer_idx=0)
        attn = self.self_attn
        bias = config.attention_bias
        attn.q_proj = nn.Linear(2 * h, config.num_attention_heads * attn.head_dim, bias=bias)
        attn.k_proj = nn.Linear(2 * h, config.num_key_value_heads * attn.head_dim, bias=bias)
        attn.v_proj = nn.Linear(2 * h, config.num_key_value_heads * attn.head_dim, bias=bias)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=config.rms_norm_eps)

    def _qkv(
        self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v ([B, heads, T, d], k/v GQA-repeated, RoPE applied) and the residual."""
        attn = self.self_attn
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [B, T, 2H]
        shape = (*x.shape[:-1], -1, attn.head_dim)
        q = attn.q_proj(x).view(shape).transpose(1, 2)  # [B, nh, T, d]
        k = attn.k_proj(x).view(shape).transpose(1, 2)  # [B, nkv, T, d]
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = repeat_kv(k, attn.num_key_value_groups), repeat_kv(v, attn.num_key_value_groups)
        return q, k, v, residual

    def _finish(self, attended: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        out = self.self_attn.o_proj(attended.transpose(1, 2).flatten(2)) + residual
        return out + self.mlp(self.post_attention_layernorm(out))

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, past: list[KV]
    ) -> tuple[torch.Tensor, KV]:
        """One TTT step over whole sequences (attention pattern of `ttt_attention`)."""
        q, k, v, residual = self._qkv(embeds, hidden, cos, sin)
        return self._finish(ttt_attention(q, k, v, past, self.self_attn.scaling), residual), (k, v)

    def decode(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: DraftCache,
        allowed: torch.Tensor,
    ) -> torch.Tensor:
        """Inference: append this call's keys to `cache`; `allowed` [T, len(cache) + T] says which keys each
        new query sees (causal for a chain, ancestors for a tree)."""
        q, k, v, residual = self._qkv(embeds, hidden, cos, sin)
        keys, values = cache.append(k, v)
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, scale=self.self_attn.scaling)
        return self._finish(attended, residual)


class DraftCache:
    """The draft's KV cache at inference: [B, heads, S, d] tensors that grow by `append` and roll back by `crop`."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> KV:
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=-2)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=-2)
        return self.keys, self.values

    def crop(self, length: int) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[..., :length, :], self.values[..., :length, :]


class Eagle3Draft(nn.Module):
    """Weight names follow the speculators/vLLM format (`fc`, `layers.0.*`, `norm`, `lm_head`, `d2t`, `t2d`, and
    `input_norm` with norm_before_fc)."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = config
        llama = config.llama
        h = llama.hidden_size
        fused = len(config.aux_layer_ids) * config.target_hidden_size
        self.input_norm = LlamaRMSNorm(fused, eps=llama.rms_norm_eps) if config.norm_before_fc else None
        self.fc = nn.Linear(fused, h, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(llama, config.norm_before_residual)])
        self.norm = LlamaRMSNorm(h, eps=llama.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(config.target_vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        self.rotary_emb = LlamaRotaryEmbedding(llama)
        d2t, t2d = first_ids(config.draft_vocab_size, config.target_vocab_size)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)
        self.gradient_checkpointing = False

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """The draft's input embedding of `tokens` (the target's, frozen)."""
        return self.embed_tokens(tokens)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's concatenated aux states [..., A*H_target] -> the first hidden input [..., H]."""
        return self.fc(aux if self.input_norm is None else self.input_norm(aux))

    def _outputs(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the hidden fed back as the next step's h, draft-vocab logits) from the layer's pre-norm output."""
        normed = self.norm(out)
        return (normed if self.config.norm_output else out), self.lm_head(normed)

    def _layer(
        self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, past: list[KV]
    ) -> tuple[torch.Tensor, KV]:
        """One draft step's layer: (its pre-norm output, this step's k/v)."""
        embeds = self.embed(tokens).to(hidden.dtype)
        cos, sin = self.rotary_emb(hidden, positions)
        layer = self.layers[0]
        if self.gradient_checkpointing and self.training:
            # A snapshot of `past`: the caller appends later steps to its list, and the recomputation in
            # backward must see the keys this step saw.
            return checkpoint(layer, embeds, hidden, cos, sin, list(past), use_reentrant=False)
        return layer(embeds, hidden, cos, sin, past)

    def step(
        self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, past: list[KV]
    ) -> tuple[torch.Tensor, torch.Tensor, KV]:
        """One draft step: (the output to feed back, draft-vocab logits, this step's k/v)."""
        out, kv = self._layer(tokens, hidden, positions, past)
        return *self._outputs(out), kv

    def decode(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: DraftCache,
        allowed: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inference step over T new inputs [1, T] (hidden already fused by `fc`, or a previous output):
        (outputs to feed back, draft-vocab logits). See `Eagle3Layer.decode` for `allowed`."""
        embeds = self.embed(tokens).to(hidden.dtype)
        cos, sin = self.rotary_emb(hidden, positions)
        return self._outputs(self.layers[0].decode(embeds, hidden, cos, sin, cache, allowed))

    def ttt_forward(
        self, tokens: torch.Tensor, aux: torch.Tensor, positions: torch.Tensor, steps: int, logits: bool = True
    ) -> list[torch.Tensor]:
        """Unrolled training forward. tokens/positions: [B, T] (already shifted, see training.ttt);
        aux: [B, T, A*H_target]. Returns the logits of each step, [B, T, draft_vocab], or without `logits` each
        step's output through the final norm [B, T, H] (the lm_head's input: a loss applies the head by chunks)."""
        hidden = self.fuse(aux)
        past: list[KV] = []
        outs = []
        for i in range(steps):
            # Teacher forcing: step i at index j reads the data token i places further on.
            step_tokens = F.pad(tokens[:, i:], (0, i)) if i else tokens
            out, kv = self._layer(step_tokens, hidden, positions + i, past)
            normed = self.norm(out)
            hidden = normed if self.config.norm_output else out
            past.append(kv)
            outs.append(self.lm_head(normed) if logits else normed)
        return outs
