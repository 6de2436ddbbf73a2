"""Per-position divergences between the target's distribution p and the draft's q (both over the draft vocabulary).

    ce           -sum p log q                        training's default; = forward KL + H(p), same gradient
    forward_kl   sum p (log p - log q)               mass-covering
    reverse_kl   sum q (log q - log p)               mode-seeking
    jsd          beta KL(p || m) + (1 - beta) KL(q || m),  m = beta p + (1 - beta) q     (OSD's JSD mix)
    tvd          1/2 sum |p - q| = 1 - sum min(p, q) = 1 - the probability a sampled draft is accepted
    lk           -log sum min(p, q)                  LK loss: -log(acceptance); TV's gradient scaled by 1/alpha
    lk_hybrid    w KL(p || q) + (1 - w) TV,  w = exp(-eta * alpha) with alpha not differentiated (eta 3)

alpha = sum min(p, q) is the acceptance rate of a sampled draft token. The LK losses (Samarin et al., "LK Losses:
Direct Acceptance Rate Optimization for Speculative Decoding", arXiv 2602.23881; shipped by `speculators`) aim at
it directly; the hybrid leans on KL while alpha is small and on TV as it grows.
Training (`draft.loss`) and online distillation (`osd.divergence`) select one; every value is >= 0 and 0 when
q = p, except ce (H(p)).
"""

from __future__ import annotations

import torch

from speculators_train.families.base import Divergence

LK_ETA = 3.0  # the paper's best hybrid setting
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
    if kind == "lk":
        return -torch.minimum(p, q).sum(-1).clamp_min(_TINY).log()
    if kind == "lk_hybrid":
        alpha = torch.minimum(p, q).sum(-1)
        weight = torch.exp(-LK_ETA * alpha.detach())
        return weight * (p * (log_p - log_q)).sum(-1) + (1 - weight) * (1 - alpha)
    raise ValueError(f"unknown divergence {kind!r}")
