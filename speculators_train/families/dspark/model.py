"""DSpark draft (arXiv 2607.05147; speculators' DSparkDraftModel, vLLM's `method: dspark`): DFlash's backbone with
every slot of a block proposing, and two heads.

    slot i of a block anchored at a proposes x_{a+i+1} (speculators' `sample_from_anchor: true`): B per forward
    markov   logits_i = lm_head(h_i) + w2(e_i),  e_i = w1[x_{a+i}]    the token before slot i's own (target ids);
             in training the real token, at inference the one drafted at slot i - 1 (the anchor at slot 0)
             gated: w2(sigmoid(gate_proj([h_i; e_i])) * e_i); rnn: a state s over the block,
             [g; c; o] = joint_proj([s; e_i; h_i]), s <- g s + (1 - g) tanh c, bias w2(tanh o), g = sigmoid(g)
    confidence  sigmoid(proj([h_i; e_i])) (or proj(h_i)): slot i's acceptance 1 - TV(target, draft), trained by BCE

h_i is slot i's output through the final norm, as speculators, vLLM and llama.cpp read it.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from pydantic import StrictBool
from torch import nn

from speculators_train.families.block.model import DFlashConfig, DFlashDraft, checked_dflash_config
from speculators_train.families.draft_config import Bounded, draft_config, spelled
from speculators_train.families.dspark.settings import MAX_MARKOV_RANK


@draft_config
class DSparkConfig(DFlashConfig):
    markov_rank: Bounded(0, MAX_MARKOV_RANK) = 256
    markov_head_type: Literal["vanilla", "gated", "rnn"] = "vanilla"
    confidence_head: StrictBool = True
    confidence_head_with_markov: StrictBool = True

    @classmethod
    def with_heads(cls, base: DFlashConfig, settings: Any) -> DSparkConfig:
        """`base`'s backbone with the heads `settings` (a recipe's `draft:` section) asks for."""
        heads = ("markov_rank", "markov_head_type", "confidence_head", "confidence_head_with_markov")
        return cls(**base.to_dict(), **{name: getattr(settings, name) for name in heads})


def checked_dspark_config(values: dict[str, Any], keys: dict[str, str] | None = None) -> DSparkConfig:
    """A DSparkConfig from a file's values (ValueError names the key as the file spells it)."""
    config = checked_dflash_config(values, keys, DSparkConfig)
    if config.confidence_head and config.confidence_head_with_markov and not config.markov_rank:
        raise ValueError(f"{spelled(keys)('confidence_head_with_markov')} is true without a Markov head (rank 0)")
    return config


class MarkovHead(nn.Module):
    """The low-rank bias w2(w1[previous token]) on a slot's draft-vocab logits, as speculators names its weights."""

    def __init__(self, target_vocab: int, draft_vocab: int, rank: int, hidden: int, kind: str) -> None:
        super().__init__()
        self.kind, self.rank = kind, rank
        self.markov_w1 = nn.Embedding(target_vocab, rank)
        nn.init.normal_(self.markov_w1.weight, std=0.01)  # a small bias at the start: DFlash's logits lead
        self.markov_w2 = nn.Linear(rank, draft_vocab, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def step(
        self, previous: torch.Tensor, normed: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(bias [..., D], the next state) of slots whose previous tokens embed as `previous` [..., r] and whose
        outputs are `normed` [..., H]; `state` [..., r] is the rnn's over the slots before (None elsewhere)."""
        if self.kind == "vanilla":
            return self.markov_w2(previous), state
        if self.kind == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat([normed, previous], dim=-1)))
            return self.markov_w2(gate * previous), state
        assert state is not None
        gate, candidate, out = self.joint_proj(torch.cat([state, previous, normed], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1 - gate) * torch.tanh(candidate)
        return self.markov_w2(torch.tanh(out)), state

    def start(self, like: torch.Tensor) -> torch.Tensor | None:
        """The rnn's state before a block's first slot, shaped like `like` [..., r] (None for the stateless kinds)."""
        return torch.zeros_like(like) if self.kind == "rnn" else None

    def block_bias(self, previous: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        """The bias [..., P, D] of a block's P slots in order (`previous` [..., P, r], `normed` [..., P, H])."""
        if self.kind != "rnn":
            return self.step(previous, normed, None)[0]
        state = self.start(previous[..., 0, :])
        biases = []
        for i in range(previous.shape[-2]):
            bias, state = self.step(previous[..., i, :], normed[..., i, :], state)
            biases.append(bias)
        return torch.stack(biases, dim=-2)


class ConfidenceHead(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 1)


class DSparkDraft(DFlashDraft):
    """DFlash's weights plus `markov_head.*` and `confidence_head.proj.*` (speculators' names)."""

    first_slot: ClassVar[int] = 0

    def __init__(self, config: DSparkConfig) -> None:
        super().__init__(config)
        hidden = config.qwen3.hidden_size
        self.markov_head = None
        if config.markov_rank:
            self.markov_head = MarkovHead(
                config.target_vocab_size, config.draft_vocab_size, config.markov_rank, hidden, config.markov_head_type
            )
        self.confidence_head = None
        if config.confidence_head:
            self.confidence_head = ConfidenceHead(hidden + (config.markov_rank if self.reads_markov else 0))

    @property
    def reads_markov(self) -> bool:
        """Whether the confidence head reads the previous token's Markov embedding too."""
        return self.markov_head is not None and self.config.confidence_head_with_markov

    @property
    def predicts_acceptance(self) -> bool:
        return self.confidence_head is not None

    def slot_logits(self, normed: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(normed)
        if self.markov_head is None:
            return logits
        return logits + self.markov_head.block_bias(self.markov_head.markov_w1(previous), normed)

    def confidence_logits(self, normed: torch.Tensor, previous: torch.Tensor) -> torch.Tensor | None:
        if self.confidence_head is None:
            return None
        features = normed
        if self.reads_markov:
            features = torch.cat([normed, self.markov_head.markov_w1(previous)], dim=-1)
        return self.confidence_head.proj(features).squeeze(-1)
