"""The MLP speculator (IBM, arXiv 2404.19124), in the layout vLLM's `MLPSpeculator` loads.

    s_0      = z_t, or ln0(z_t) / sqrt(2) with scale_input      z_t: the target's post-norm last state at t
    stage i  = s_{i+1} = GELU(ln_i(proj_i(s_i) + (emb_weight / state_weight) * emb_i(x_{t+1+i})))
               logits_i = head_i(s_{i+1})                      stage i proposes x_{t+2+i}
    state_weight = 0.5 ** (0.5 / n_predict), emb_weight = sqrt((1 - state_weight**2) * inner_dim / 2)

Stage i is fed x_{t+1+i}: the target's pending token for stage 0, then each stage's own draft, so a later stage
sees the earlier drafts (Medusa's heads do not). ln_i is an RMS norm with a weight and a bias (eps 1e-6); ln0 has
neither. `tie_weights` shares emb, ln and proj_1.. across stages (proj_0 maps the target's width to inner_dim),
held once at the first index using each (emb.0, ln.0, proj.1); the heads are never shared. The vocabulary is
the target's whole one: vLLM builds each head at `vocab_size` rows.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import StrictBool
from torch import nn

from speculators_train.families.draft_config import Bounded, Hidden, Vocab, checked, draft_config, spelled
from speculators_train.families.format_common import MAX_HIDDEN, MAX_LAYERS
from speculators_train.families.mlp.settings import MAX_STAGES

EPS = 1e-6


@draft_config
class MLPConfig:
    """Everything needed to rebuild the speculator; saved as JSON beside its weights."""

    emb_dim: Hidden  # the target's hidden size
    inner_dim: Bounded(0, MAX_HIDDEN)  # 0 means the target's width, as vLLM reads it
    n_predict: Bounded(1, MAX_STAGES)
    vocab_size: Vocab  # the target's
    tie_weights: StrictBool = False
    scale_input: StrictBool = False
    target_num_layers: Bounded(0, MAX_LAYERS) = 0

    def __post_init__(self) -> None:
        self.inner_dim = self.inner_dim or self.emb_dim

    @property
    def target_hidden_size(self) -> int:
        return self.emb_dim

    @property
    def target_vocab_size(self) -> int:
        return self.vocab_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def checked_config(values: dict[str, Any], keys: dict[str, str] | None = None) -> MLPConfig:
    """An MLPConfig from `values` (its fields, as read from a file), each typed and in range first. ValueError names
    a field as the file spells it (`keys`: where it differs)."""
    config = checked(MLPConfig, values, keys)
    name = spelled(keys)
    if config.tie_weights and config.n_predict < 2:
        raise ValueError(f"{name('tie_weights')}: true needs {name('n_predict')} >= 2, got {config.n_predict}")
    return config


class StageNorm(nn.Module):
    """x / rms(x), then (with `affine`) times a weight plus a bias."""

    def __init__(self, size: int, affine: bool = True) -> None:
        super().__init__()
        self.affine = affine
        if affine:
            self.weight = nn.Parameter(torch.ones(size))
            self.bias = nn.Parameter(torch.zeros(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
        return self.weight * y + self.bias if self.affine else y


class MLPDraft(nn.Module):
    def __init__(self, config: MLPConfig) -> None:
        super().__init__()
        self.config = config
        n, d, v = config.n_predict, config.inner_dim, config.vocab_size
        if config.tie_weights:  # each shared module once, at the first index that uses it (vLLM's names)
            self.emb = nn.ModuleList([nn.Embedding(v, d)])
            self.proj = nn.ModuleList([nn.Linear(config.emb_dim, d, bias=False), nn.Linear(d, d, bias=False)])
            self.ln = nn.ModuleList([StageNorm(d)])
        else:
            self.emb = nn.ModuleList([nn.Embedding(v, d) for _ in range(n)])
            self.proj = nn.ModuleList([nn.Linear(config.emb_dim if i == 0 else d, d, bias=False) for i in range(n)])
            self.ln = nn.ModuleList([StageNorm(d) for _ in range(n)])
        self.head = nn.ModuleList([nn.Linear(d, v, bias=False) for _ in range(n)])
        if config.scale_input:
            self.ln0 = StageNorm(config.emb_dim, affine=False)
        self.state_weight = 0.5 ** (0.5 / n)
        self.emb_weight = math.sqrt((1 - self.state_weight**2) * (d / 2))
        self.gradient_checkpointing = False

    def start(self, state: torch.Tensor) -> torch.Tensor:
        """The first stage's input from the target's post-norm state."""
        return self.ln0(state) / math.sqrt(2) if self.config.scale_input else state

    def advance(self, i: int, state: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
        """Stage i's state from the current state and the token stage i is fed."""
        emb, proj, ln = (modules[min(i, len(modules) - 1)] for modules in (self.emb, self.proj, self.ln))
        return F.gelu(ln(proj(state) + emb(token) * (self.emb_weight / self.state_weight)))

    def stage(self, i: int, state: torch.Tensor, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the next state, stage i's logits) from the current state and the token stage i is fed."""
        state = self.advance(i, state, token)
        return state, self.head[i](state)
