"""P-EAGLE draft: the EAGLE-3 draft (fused target states + a Llama decoder layer over [embedding ; hidden]) that
proposes K tokens in one forward (arXiv 2602.01469; speculators' PEagleSpeculator, vLLM's `parallel_drafting`).

    depth 0 at index j   reads (x_{j+1}, fc(g_j)) at RoPE position j+1, as EAGLE-3: it predicts x_{j+2}
    depth d >= 1         reads (embed(mask_token_id), fc(mask_hidden)) at position j+1+d: it predicts x_{j+2+d}

`mask_hidden` is a learned [1, 1, A*H_target] vector in the pre-fc space (through `input_norm` too with
norm_before_fc). A depth-d slot of the chain anchored at j attends to the depth-0 slots 0..j (causal) and to its own
chain's slots of depths 1..d; no draft output is fed back, so all K slots run in one forward at inference.

The embedding is the target's, frozen, except the mask token's row, which is trained (`mask_embedding`): every
lookup of `mask_token_id` reads it, in training, in the verify loop and in the exported `embed_tokens` alike, so a
real occurrence of that id in a prompt is embedded the same way everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from speculators_train.families.draft_config import Bounded, draft_config, spelled, within
from speculators_train.families.eagle.model import Eagle3Config, Eagle3Draft, checked_config
from speculators_train.families.format_common import MAX_VOCAB
from speculators_train.families.peagle.settings import MAX_DEPTHS


@draft_config
class PEagleConfig(Eagle3Config):
    """The EAGLE-3 config, plus the mask token and the number of depths trained (the most tokens one forward
    proposes that were trained to be right)."""

    mask_token_id: Bounded(0, MAX_VOCAB - 1) = 0  # a target id (`checked_peagle_config`)
    depths: Bounded(1, MAX_DEPTHS) = 8


def checked_peagle_config(values: dict[str, Any], keys: dict[str, str] | None = None) -> PEagleConfig:
    """A PEagleConfig from a file's values, each typed and in range first (ValueError names the key)."""
    config = checked_config(values, keys, PEagleConfig)
    if config.norm_output:
        raise ValueError("norm_output is set, but a P-EAGLE draft feeds nothing back between depths")
    within(config.mask_token_id, 0, config.target_vocab_size - 1, spelled(keys)("mask_token_id"))
    return config


@dataclass
class Chains:
    """Which chains a training forward runs past depth 0, depth by depth (d = 1..D-1): `anchors[d-1]` [B, n_d]
    holds the anchor index j of each chain (padding: `present` false), sorted; a chain at depth d is at every depth
    below it, and `slots[d-1]` [B, L] maps an anchor to its slot in `anchors[d-1]` (-1: not sampled there)."""

    anchors: list[torch.Tensor]
    present: list[torch.Tensor]
    slots: list[torch.Tensor]


def sample_chains(
    trained: torch.Tensor, depths: int, ratio: float, ratio_min: float, everything: bool = False
) -> Chains:
    """COD sampling, as speculators' P-EAGLE trainer: depth 0 keeps every position; depth d keeps
    int((n - d) * max(ratio**d, ratio_min)) chains of a row with n trained targets, drawn uniformly from the
    chains kept at depth d - 1 whose depth-d target is trained (so chains stay nested). `everything`: keep every
    such chain (validation: no sampling noise). trained [B, L]: the target at index i is an assistant token."""
    batch, length = trained.shape
    cpu = trained.detach().cpu()
    # depth-1 candidates: anchor j whose index j + 1 is trained
    candidates = [torch.nonzero(row[1:]).flatten() for row in cpu]
    counts = cpu.sum(1).tolist()
    anchors, present, slots = [], [], []
    for d in range(1, depths):
        kept = []
        for b in range(batch):
            pool = candidates[b]
            size = len(pool) if everything else int(max(0, counts[b] - d) * max(ratio**d, ratio_min))
            if size < len(pool):
                pool = pool[torch.randperm(len(pool))[:size]].sort().values
            kept.append(pool)
            nxt = pool[pool + d + 1 < length]  # the chain continues if its depth-(d+1) target is trained
            candidates[b] = nxt[cpu[b, nxt + d + 1]]
        width = max(len(k) for k in kept)
        if width == 0:
            break
        idx = torch.zeros(batch, width, dtype=torch.long)
        here = torch.zeros(batch, width, dtype=torch.bool)
        slot = torch.full((batch, length), -1, dtype=torch.long)
        for b, k in enumerate(kept):
            idx[b, : len(k)], here[b, : len(k)] = k, True
            slot[b, k] = torch.arange(len(k))
        device = trained.device
        anchors.append(idx.to(device))
        present.append(here.to(device))
        slots.append(slot.to(device))
    return Chains(anchors, present, slots)


class PEagleDraft(Eagle3Draft):
    """Weight names follow speculators' PEagleSpeculator: the EAGLE-3 set plus `mask_hidden`; `mask_embedding` is
    written into `embed_tokens` at `mask_token_id` on export."""

    def __init__(self, config: PEagleConfig) -> None:
        super().__init__(config)
        fused = len(config.aux_layer_ids) * config.target_hidden_size
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, fused))
        self.mask_embedding = nn.Parameter(torch.zeros(config.llama.hidden_size))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        base = self.embed_tokens(tokens)
        is_mask = (tokens == self.config.mask_token_id)[..., None]
        return torch.where(is_mask, self.mask_embedding.to(base.dtype), base)

    def embedding_table(self) -> torch.Tensor:
        """The whole input embedding as engines load it: the target's rows, the mask row trained."""
        table = self.embed_tokens.weight.detach().clone()
        table[self.config.mask_token_id] = self.mask_embedding.detach().to(table.dtype)
        return table

    def mask_inputs(self, count: int, batch: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(embeddings, fused hidden) of `count` mask slots: [batch, count, H] each."""
        hidden = self.fuse(self.mask_hidden.to(dtype))
        h = hidden.shape[-1]
        return self.mask_embedding.to(dtype).expand(batch, count, h), hidden.expand(batch, count, h)

    def parallel_forward(
        self, tokens: torch.Tensor, aux: torch.Tensor, positions: torch.Tensor, chains: Chains, logits: bool = True
    ) -> list[torch.Tensor]:
        """Training forward over every depth at once. tokens/positions [B, L] (x_{j+1}, j+1), aux [B, L, A*H];
        returns the logits of depth 0 at every index [B, L, V] and of depth d at `chains.anchors[d-1]`
        [B, n_d, V], or without `logits` those outputs through the final norm [.., H] (a loss applies the head by
        chunks)."""
        head = self.lm_head if logits else nn.Identity()
        layer = self.layers[0]
        scale = layer.self_attn.scaling
        hidden = self.fuse(aux)
        cos, sin = self.rotary_emb(hidden, positions)
        q0, k0, v0, residual = layer._qkv(self.embed(tokens).to(hidden.dtype), hidden, cos, sin)
        out0 = F.scaled_dot_product_attention(q0, k0, v0, is_causal=True, scale=scale)
        outs = [head(self.norm(layer._finish(out0, residual)))]
        length = tokens.shape[1]
        keys: list[torch.Tensor] = []  # per depth >= 1: k, v of its slots [B, nh, n_e, d]
        values: list[torch.Tensor] = []
        for d, anchors in enumerate(chains.anchors, start=1):
            batch, n = anchors.shape
            embeds, mask_hidden = self.mask_inputs(n, batch, hidden.dtype)
            cos, sin = self.rotary_emb(hidden, positions.gather(1, anchors) + d)
            q, k, v, residual = layer._qkv(embeds, mask_hidden, cos, sin)
            # depth-0 keys at indices <= the anchor; then this chain's own slots at depths 1..d
            causal = torch.arange(length, device=anchors.device)[None, None, :] <= anchors[:, :, None]
            scores0 = (q @ k0.transpose(-1, -2)) * scale  # [B, nh, n, L]
            scores0 = scores0.masked_fill(~causal[:, None], float("-inf"))
            own_k, own_v = [], []
            for e in range(1, d):
                slot = chains.slots[e - 1].gather(1, anchors).clamp(min=0)  # padded chains read slot 0: unused
                index = slot[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[-1])
                own_k.append(keys[e - 1].gather(2, index))
                own_v.append(values[e - 1].gather(2, index))
            own_k.append(k)
            own_v.append(v)
            chain_scores = torch.stack([(q * ks).sum(-1) for ks in own_k], dim=-1) * scale  # [B, nh, n, d]
            softmax_dtype = torch.promote_types(q.dtype, torch.float32)
            probs = torch.softmax(torch.cat([scores0, chain_scores], -1), dim=-1, dtype=softmax_dtype).to(q.dtype)
            out = probs[..., :length] @ v0
            for e, vs in enumerate(own_v):
                out = out + probs[..., length + e, None] * vs
            keys.append(k)
            values.append(v)
            outs.append(head(self.norm(layer._finish(out, residual))))
        return outs
