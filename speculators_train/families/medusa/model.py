"""Medusa heads (Medusa-1: the target stays frozen).

    z      = norm(h_N)                  the target's last post-norm hidden state at position t [.., H]
    head h = lm_head_h(block_L(...block_1(z)))      block(x) = x + SiLU(W x + b)
             head h predicts token t+2+h (the target's own lm_head gives t+1)

Blocks start at zero, so every head starts as the target's lm_head restricted to the draft vocabulary (the same
reduced vocabulary and d2t/t2d maps as EAGLE-3). Weight names follow vLLM's Medusa format:
`blocks.{h}.layers.{l}.weight/.bias`, `lm_heads.{h}.weight`.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from speculators_train.architectures import text_config
from speculators_train.families.draft_config import Bounded, Hidden, Vocab, checked, draft_config, spelled, within
from speculators_train.families.format_common import MAX_LAYERS
from speculators_train.families.medusa.settings import MAX_BLOCKS, MAX_HEADS
from speculators_train.families.vocab import first_ids


@draft_config
class MedusaConfig:
    """Everything needed to rebuild the heads; saved as JSON beside their weights."""

    hidden_size: Hidden
    num_heads: Bounded(1, MAX_HEADS)
    num_layers: Bounded(1, MAX_BLOCKS)
    draft_vocab_size: Vocab  # at most target_vocab_size (`checked_config`)
    target_vocab_size: Vocab
    target_num_layers: Bounded(0, MAX_LAYERS) = 0

    @property
    def target_hidden_size(self) -> int:
        return self.hidden_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def checked_config(values: dict[str, Any], keys: dict[str, str] | None = None) -> MedusaConfig:
    """A MedusaConfig from `values` (its fields, as read from a file), each typed and in range first. ValueError
    names a field as the file spells it: `keys` maps a field to that spelling where it differs (vLLM's format)."""
    config = checked(MedusaConfig, values, keys)
    within(config.draft_vocab_size, 1, config.target_vocab_size, spelled(keys)("draft_vocab_size"))
    return config


class ResBlock(nn.Linear):
    """x + SiLU(W x + b); a Linear itself, so its weights are named `layers.{l}.weight/.bias` as vLLM reads them."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__(hidden_size, hidden_size)
        nn.init.zeros_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(super().forward(x))


class MedusaBlocks(nn.Module):
    """The residual blocks of one head (a container so names read `blocks.{h}.layers.{l}`)."""

    def __init__(self, hidden_size: int, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([ResBlock(hidden_size) for _ in range(num_layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class MedusaDraft(nn.Module):
    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.blocks = nn.ModuleList([MedusaBlocks(h, config.num_layers) for _ in range(config.num_heads)])
        self.lm_heads = nn.ModuleList([nn.Linear(h, config.draft_vocab_size, bias=False) for _ in self.blocks])
        d2t, t2d = first_ids(config.draft_vocab_size, config.target_vocab_size)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)
        self.gradient_checkpointing = False

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Post-norm target states [.., H] -> draft-vocab logits of every head [num_heads, .., draft_vocab]."""
        return torch.stack([self.head_logits(h, self.head_states(h, hidden)) for h in range(self.config.num_heads)])

    def head_states(self, h: int, hidden: torch.Tensor) -> torch.Tensor:
        """Head h's block over post-norm target states (the part of a head that is not vocabulary-wide)."""
        return self.blocks[h](hidden)

    def head_logits(self, h: int, states: torch.Tensor) -> torch.Tensor:
        """Head h's draft-vocabulary logits from its block's states."""
        return self.lm_heads[h](states)

    @classmethod
    def for_target(
        cls, target_config, lm_head_rows: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor, heads: int, layers: int
    ) -> MedusaDraft:
        """Heads shaped for the target, each lm_head starting from the target's rows of the draft vocabulary."""
        text = text_config(target_config)
        config = MedusaConfig(
            hidden_size=text.hidden_size,
            num_heads=heads,
            num_layers=layers,
            draft_vocab_size=d2t.numel(),
            target_vocab_size=text.vocab_size,
            target_num_layers=text.num_hidden_layers,
        )
        draft = cls(config)
        with torch.no_grad():
            for head in draft.lm_heads:
                head.weight.copy_(lm_head_rows)
            draft.d2t.copy_(d2t)
            draft.t2d.copy_(t2d)
        return draft
