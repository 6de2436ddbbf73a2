"""DFlash2 draft (speculators' DFlash2DraftModel; vLLM's `DFlash2DraftModel` under `method: dflash`): DFlash's
backbone over the target's whole vocabulary, with two additions.

    conv     around attention and around the MLP of every layer, a causal convolution over the block's slots,
             grouped by channel: out_i = sum_{t < kernel, t <= i} x_{i-t} * (base_t + delta_{i,t}[group]), where
             delta = kernel_projection(x_i) gives the input side's and the output side's taps (the output side
             applies them to the sublayer's output); identity at the start (base tap 0 = 1, projection 0)
    selector over each slot's unary top-k candidates c: score(c) = logit(c) + <pred[prev] * W h, succ[c]>, prev
             the token before the slot's own (the anchor at the first proposing slot, then the chosen candidate)

Training adds a k-way cross-entropy over the top-k (the target injected at rank k where missing), as
speculators' `selector_training_candidates`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from speculators_train.families.block.model import DFlashConfig, DFlashDraft, DFlashLayer, checked_dflash_config
from speculators_train.families.draft_config import Bounded, draft_config, spelled

OPTIONS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")  # DFlash2's, beside DFlash's


@draft_config
class DFlash2Config(DFlashConfig):
    conv_kernel_size: Bounded(1, 64) = 2
    conv_group_size: Bounded(1, 1 << 16) = 16
    selector_rank: Bounded(1, 4096) = 256
    selector_top_k: Bounded(1, 1024) = 16


def checked_dflash2_config(values: dict[str, Any], keys: dict[str, str] | None = None) -> DFlash2Config:
    config = checked_dflash_config(values, keys, DFlash2Config)
    name, hidden = spelled(keys), config.layer_config["hidden_size"]
    if hidden % config.conv_group_size:
        raise ValueError(f"{name('conv_group_size')} {config.conv_group_size} does not divide hidden_size {hidden}")
    if config.conv_kernel_size > config.block_size:
        raise ValueError(f"{name('conv_kernel_size')} {config.conv_kernel_size} exceeds block_size")
    if config.draft_vocab_size != config.target_vocab_size:
        raise ValueError(f"{name('draft_vocab_size')} must be the target's whole vocabulary for DFlash2")
    if config.selector_top_k > config.target_vocab_size:
        raise ValueError(f"{name('selector_top_k')} exceeds the vocabulary")
    return config


def block_conv(x: torch.Tensor, base: torch.Tensor, delta: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., S, H] convolved causally over the S slots: base [kernel, H], delta [..., S, kernel, H / group]."""
    out = torch.zeros_like(x)
    for tap in range(base.shape[0]):
        if tap >= x.shape[-2]:
            break
        shifted = x[..., : x.shape[-2] - tap, :]
        coefficient = base[tap] + delta[..., tap:, tap, :].repeat_interleave(group, dim=-1)
        out[..., tap:, :] = out[..., tap:, :] + shifted * coefficient
    return out


class GroupedDynamicConv(nn.Module):
    """speculators' GroupedDynamicCausalConv weights: `base_kernel` [2, kernel, H], `kernel_projection`."""

    def __init__(self, hidden: int, kernel: int, group: int) -> None:
        super().__init__()
        self.kernel, self.group = kernel, group
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel * (hidden // group), bias=False)
        with torch.no_grad():
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kernels = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel, -1)
        return block_conv(x, self.base_kernel[0], kernels[..., 0, :, :], self.group), kernels[..., 1, :, :]

    def finish(self, out: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return block_conv(out, self.base_kernel[1], delta, self.group)


class DFlash2Layer(DFlashLayer):
    def __init__(self, config: DFlash2Config) -> None:
        super().__init__(config.qwen3)
        hidden = config.qwen3.hidden_size
        self.attention_conv = GroupedDynamicConv(hidden, config.conv_kernel_size, config.conv_group_size)
        self.mlp_conv = GroupedDynamicConv(hidden, config.conv_kernel_size, config.conv_group_size)

    def before_attention(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return self.attention_conv.prepare(x)

    def around_attention(self, out: torch.Tensor, saved: Any) -> torch.Tensor:
        return self.attention_conv.finish(out, saved)

    def before_mlp(self, x: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return self.mlp_conv.prepare(x)

    def around_mlp(self, out: torch.Tensor, saved: Any) -> torch.Tensor:
        return self.mlp_conv.finish(out, saved)


class CandidateSelector(nn.Module):
    def __init__(self, vocab: int, hidden: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab, rank) * 0.02)
        self.successor_codebook = nn.Parameter(torch.randn(vocab, rank) * 0.02)
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        nn.init.normal_(self.hidden_projection.weight, std=0.02)

    def scores(
        self, logits: torch.Tensor, normed: torch.Tensor, previous: torch.Tensor, candidates: torch.Tensor
    ) -> torch.Tensor:
        """Edge scores [..., k] of `candidates` [..., k] after `previous` [...] given the slot outputs [..., H]."""
        context = self.predecessor_codebook[previous] * self.hidden_projection(normed)
        transition = (context[..., None, :] * self.successor_codebook[candidates]).sum(-1)
        return logits.gather(-1, candidates) + transition


class DFlash2Draft(DFlashDraft):
    def __init__(self, config: DFlash2Config) -> None:
        super().__init__(config)
        self.candidate_selector = CandidateSelector(
            config.target_vocab_size, config.qwen3.hidden_size, config.selector_rank, config.selector_top_k
        )

    @property
    def selects_candidates(self) -> bool:
        return True

    def make_layer(self, config: DFlashConfig) -> DFlashLayer:
        assert isinstance(config, DFlash2Config)
        return DFlash2Layer(config)

    def selector_logits(
        self, normed: torch.Tensor, previous: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        top_k = self.candidate_selector.top_k
        candidates = logits.topk(top_k, dim=-1).indices
        matches = candidates == targets[..., None]
        present = matches.any(-1)
        rank = torch.where(present, matches.long().argmax(-1), top_k - 1)
        candidates[..., -1] = torch.where(present, candidates[..., -1], targets)
        return self.candidate_selector.scores(logits, normed, previous, candidates), rank
