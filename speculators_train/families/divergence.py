"""Per-position divergences between the target's distribution p and the draft's q (both over the draft vocabulary).

    ce           -sum p log q                        training's default; = forward KL + H(p), same gradient
    forward_kl   sum p (log p - log q)               mass-covering
    reverse_kl   sum q (log q - log p)               mode-seeking
    jsd          beta KL(p || m) + (1 - beta) KL(q || m),  m = beta p + (1 - beta) q     (OSD's JSD mix)
    tvd          1/2 sum |p - q| = 1 - sum min(p, q) = 1 - the probability a sampled draft is accepted

Online distillation (`osd.divergence`) selects one; every value is >= 0 and 0 when q = p, except ce (H(p)).
"""

from __future__ import annotations

from typing import Literal

import torch

Divergence = Literal["ce", "forward_kl", "reverse_kl", "jsd", "tvd"]
_TINY = 1e-12  # keeps log(0) finite where p has zeros (a softmax over a restricted vocab rarely does)


def divergence(p: torch.Tensor, log_q: torch.Tensor, kind: Divergence = "ce", beta: float = 0.5) -> torch.Tensor:
    """[..., V] target probabilities and draft log-probabilities -> [...] divergence per position."""
    if kind == "ce":
        return -(p * log_q).sum(-1)
    log_p = p.clamp_min(_TINY).log()
    q = log_q.exp()
    if kind == "forward_kl":
        return (p * (log_p - log_q)).sum(-1)
    if kind == "reverse_kl":
        return (q * (log_q - log_p)).sum(-1)
    if kind == "jsd":
        log_m = (beta * p + (1 - beta) * q).clamp_min(_TINY).log()
        return beta * (p * (log_p - log_m)).sum(-1) + (1 - beta) * (q * (log_q - log_m)).sum(-1)
    if kind == "tvd":
        return 0.5 * (p - q).abs().sum(-1)
    raise ValueError(f"unknown divergence {kind!r}")
