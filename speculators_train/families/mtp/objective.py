"""MTP training (FastMTP, arXiv 2509.18362): the head unrolled `num_steps` times, each step a causal pass over the
sequence fed the step before's output and the data's tokens, distilling the target's distribution.

Alignment (T tokens; y = stored pre-norm final states, l = loss mask; y_j gives the target's distribution of x_{j+1}):

    step k at position t (t <= T - 3 - k) reads norm(y_t) (k = 0) or step k - 1's carry at t, and x_{t+k+1} at
    position t + k; it proposes x_{t+k+2}: target softmax(lm_head(norm(y_{t+k+1}))), scored where l_{t+k+2}

Step k's loss weight is beta**k / sum_j beta**j (FastMTP's normalised decay). `full_acc_k` counts positions where steps
0..k all give the target's greedy token, so the predicted acceptance length is 1 + sum_k full_acc_k.
"""

from __future__ import annotations

import torch

from speculators_train.chunks import chunk_rows, chunked
from speculators_train.families.divergence import Divergence, divergence
from speculators_train.families.mtp.model import MTPDraft
from speculators_train.families.objective import ChainAccuracy, Objective, Sums, global_counts, key, ratio
from speculators_train.head import TargetHead


def step_weights(beta: float, steps: int) -> list[float]:
    raw = [beta**k for k in range(steps)]
    return [w / sum(raw) for w in raw]


def mtp_loss(
    draft: MTPDraft,
    batch: dict[str, torch.Tensor],
    head: TargetHead,
    beta: float,
    kind: Divergence,
    across: bool,
    steps: int,
) -> tuple[torch.Tensor, Sums]:
    ids, final, mask = batch["input_ids"], batch["hidden_state"], batch["loss_mask"]
    length, dtype = ids.shape[1], draft.eh_proj.weight.dtype
    with torch.no_grad():
        final = final.to(head.lm_head.weight.dtype)
        hidden = head.norm(final).to(dtype)
    weights = step_weights(beta, steps)
    positions = torch.arange(length, device=ids.device)[None].expand(ids.shape[0], -1)
    total = torch.zeros((), device=ids.device)
    sums: Sums = {"vocab_coverage": ratio(mask.sum(), mask.sum())}
    chains = ChainAccuracy()
    rows = chunk_rows(ids.shape[0], draft.config.target_vocab_size)
    state = hidden
    for k in range(steps):
        n = length - 2 - k
        scored = mask[:, 2 + k :].bool()  # [B, n]: x_{t+k+2} is an assistant token
        count = scored.sum()
        denominator = global_counts(count[None])[0] if across else count.clamp(min=1)
        if n <= 0:  # a sequence shorter than the chain: later steps score nothing
            sums[key("loss", k)] = ratio(torch.zeros((), device=ids.device), count)
            sums.update(chains.step(k, scored, scored))
            continue
        out = draft.step(state[:, :n], ids[:, 1 + k : 1 + k + n], positions[:, k : k + n])

        def piece(s: torch.Tensor, y: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, ...]:
            with torch.no_grad():
                target_logits = head(y).float()
            logits = draft.logits(s).float()
            per_position = divergence(torch.softmax(target_logits, dim=-1), torch.log_softmax(logits, dim=-1), kind)
            return (per_position * m).sum(), logits.argmax(-1) == target_logits.argmax(-1)

        loss_sum, right = chunked(piece, rows, out, final[:, 1 + k : 1 + k + n], scored)
        state = draft.carry(out)
        total = total + weights[k] * loss_sum / denominator
        sums[key("loss", k)] = ratio(loss_sum, count)
        sums.update(chains.step(k, right & scored, scored))
    return total, sums


class MTPObjective(Objective):
    metric_names = ("loss", "full_acc", "cond_acc")

    def __init__(self, draft: MTPDraft, head: TargetHead, beta: float, kind: Divergence, steps: int) -> None:
        super().__init__(draft, head)
        self.steps, self.beta, self.kind = steps, beta, kind

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Sums]:
        return mtp_loss(self.draft, batch, self.head, self.beta, self.kind, self.training, self.steps)
