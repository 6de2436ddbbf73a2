"""MLP speculator training: every stage distils the target's distribution at its own future position, fed the data's
tokens (teacher forcing: what the loop feeds it whenever the earlier drafts were right).

Alignment (T tokens; y = stored pre-norm final states, l = loss mask; y_j gives the target's distribution of x_{j+1}):

    stage i at position t (t <= T - 2 - i) reads norm(y_t) through the earlier stages and x_{t+1+i}, and predicts
    x_{t+2+i}: target softmax(lm_head(norm(y_{t+1+i}))), scored where l_{t+2+i}

Stage i's loss weight is decay**i. `full_acc_i` counts positions where stages 0..i all give the target's greedy token
(the chain a verifier accepts), so the predicted acceptance length is 1 + sum_i full_acc_i.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from speculators_train.chunks import chunk_rows, chunked
from speculators_train.families.divergence import Divergence, divergence
from speculators_train.families.mlp.model import MLPDraft
from speculators_train.families.objective import ChainAccuracy, Objective, Sums, global_counts, key, ratio
from speculators_train.head import TargetHead


def mlp_loss(
    draft: MLPDraft, batch: dict[str, torch.Tensor], head: TargetHead, decay: float, kind: Divergence, across: bool
) -> tuple[torch.Tensor, Sums]:
    """Each stage's divergence over chunks of positions (`chunks.chunked`): no whole-vocabulary logits of a long
    sample, the target's or a stage's, exist at once."""
    ids, final, mask = batch["input_ids"], batch["hidden_state"], batch["loss_mask"]
    length, stages = ids.shape[1], draft.config.n_predict
    with torch.no_grad():
        final = final.to(head.lm_head.weight.dtype)
        hidden = head.norm(final)
    padded_mask = F.pad(mask, (0, 2), value=False)
    trained = [padded_mask[:, 2 + i : 1 + length] for i in range(stages)]  # [B, T - 1 - i]: x_{t+2+i} scored
    counts = torch.stack([t.sum() for t in trained])
    denominators = global_counts(counts) if across else counts.clamp(min=1)
    state = draft.start(hidden.to(draft.head[0].weight.dtype)[:, : length - 1])
    total = torch.zeros((), device=ids.device)
    sums: Sums = {"vocab_coverage": ratio(counts[0], counts[0])}
    chains = ChainAccuracy()
    rows = chunk_rows(ids.shape[0], draft.config.vocab_size)
    for i in range(stages):
        n = length - 1 - i
        if n <= 0:  # a sequence shorter than the chain: later stages score nothing
            sums[key("loss", i)] = ratio(torch.zeros((), device=ids.device), counts[i])
            sums.update(chains.step(i, trained[i], trained[i]))
            continue
        state = draft.advance(i, state[:, :n], ids[:, 1 + i : 1 + i + n])

        def piece(s: torch.Tensor, y: torch.Tensor, m: torch.Tensor, stage: int = i) -> tuple[torch.Tensor, ...]:
            with torch.no_grad():
                target_logits = head(y).float()
            logits = draft.head[stage](s).float()
            per_position = divergence(torch.softmax(target_logits, dim=-1), torch.log_softmax(logits, dim=-1), kind)
            return (per_position * m).sum(), logits.argmax(-1) == target_logits.argmax(-1)

        loss_sum, right = chunked(piece, rows, state, final[:, 1 + i : 1 + i + n], trained[i])
        total = total + decay**i * loss_sum / denominators[i]
        sums[key("loss", i)] = ratio(loss_sum, counts[i])
        sums.update(chains.step(i, right & trained[i], trained[i]))
    return total, sums


class MLPObjective(Objective):
    metric_names = ("loss", "full_acc", "cond_acc")

    def __init__(self, draft: MLPDraft, head: TargetHead, decay: float, kind: Divergence) -> None:
        super().__init__(draft, head)
        self.steps = draft.config.n_predict
        self.decay, self.kind = decay, kind

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Sums]:
        return mlp_loss(self.draft, batch, self.head, self.decay, self.kind, self.training)
