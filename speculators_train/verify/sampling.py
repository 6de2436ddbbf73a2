"""Acceptance rules of speculative decoding. Pure functions over probabilities, so each rule is
tested on its own: greedy prefix matching, and lossless rejection sampling for chains and trees.

Chain: drafted x_i ~ q_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); the first rejection draws the
next token from norm(max(0, p_i - q_i)); if all K are accepted the bonus token is drawn from the *target's*
p_K (position K+1), never from the draft. A deterministic draft (the argmax, as vLLM and SGLang draft at T > 0) is
q_i = a point mass at x_i: accepted with probability p_i(x_i), a rejection draws from p_i without x_i.

Tree: the children of a node are deterministic top-k picks, i.e. proposals with q = a point mass. Trying them in
turn, child x is accepted with probability p(x) (= min(1, p(x)/1)); on rejection p loses x and is renormalised
(= norm(max(0, p - delta_x))). If no child is accepted the token is drawn from what is left of p. Each step is
the chain rule with a point-mass q, so the output is distributed exactly as the target's.
"""

from __future__ import annotations

import torch

from speculators_train.proposal import Sampling


def target_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The target's sampling distribution over [..., V]: temperature, then top-p (nucleus), renormalised.
    Target-only decoding samples from exactly this, so speculative decoding must reproduce it."""
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each token
        sorted_probs = sorted_probs.masked_fill(before >= sampling.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def _uniform(generator: torch.Generator | None, device: torch.device) -> float:
    return float(torch.rand((), generator=generator, device=device))


def accept_chain_greedy(draft: list[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """(accepted count a, next token): drafts agree with the target's argmax up to a; the target's argmax at a
    is the correction (or, with all K accepted, the bonus)."""
    choice = target_logits.argmax(-1).tolist()  # [K+1]
    a = 0
    while a < len(draft) and draft[a] == choice[a]:
        a += 1
    return a, choice[a]


def point_masses(draft: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """q [K, V] of deterministic drafts: row i is one-hot at draft[i]."""
    ids = torch.tensor(draft, dtype=torch.long, device=device)[:, None]
    return torch.zeros(len(draft), vocab, device=device).scatter_(1, ids, 1.0)


def accept_chain_sampled(
    draft: list[int], q: torch.Tensor | None, p: torch.Tensor, generator: torch.Generator | None
) -> tuple[int, int]:
    """Rejection sampling over a chain. q: [K, V] draft distributions the drafts were sampled from (None: each
    draft was deterministic, a point mass); p: [K+1, V] target distributions (row K is the bonus position)."""
    if q is None:
        q = point_masses(draft, p.shape[-1], p.device)
    for i, token in enumerate(draft):
        if _uniform(generator, p.device) * q[i, token] < p[i, token]:  # u < p/q without dividing by a tiny q
            continue
        residual = (p[i] - q[i]).clamp_min(0.0)
        total = residual.sum()
        # p == q leaves nothing: rejection then has probability 0, reachable only by rounding; fall back to p.
        return i, sample(residual / total if total > 0 else p[i], generator)
    return len(draft), sample(p[len(draft)], generator)


def accept_children_greedy(children: list[int], tokens: list[int], logits: torch.Tensor) -> tuple[int | None, int]:
    """(accepted child or None, the target's argmax) at one tree node."""
    choice = int(logits.argmax(-1))
    for child in children:
        if tokens[child] == choice:
            return child, choice
    return None, choice


def accept_children_sampled(
    children: list[int], tokens: list[int], p: torch.Tensor, generator: torch.Generator | None
) -> tuple[int | None, int]:
    """(accepted child or None, its token or the token drawn from the residual) at one tree node."""
    left = p.clone()
    for child in children:
        token = tokens[child]
        if _uniform(generator, p.device) < left[token]:
            return child, token
        left[token] = 0.0
        total = left.sum()
        if total <= 0:  # every token of p was a rejected child: only rounding gets here
            return None, sample(p, generator)
        left = left / total
    return None, sample(left, generator)
