"""A standalone draft's distillation loss: at every assistant position, a divergence between the draft's next-token
distribution and the target's, which comes exactly from the stored final state through the target's norm and head.

    position t of the shifted batch: the draft reads x_0 .. x_t, the target's distribution is head(y_t), both for
    x_{t+1}; scored where x_{t+1} is an assistant token (loss mask l_{t+1}).

Teacher-forced, this scores one draft step: `full_acc_0` is how often the draft's top-1 is the target's.
"""

from __future__ import annotations

import torch

from speculators_train.architectures import text_decoder
from speculators_train.chunks import chunk_rows, chunked
from speculators_train.families.divergence import Divergence, divergence
from speculators_train.families.draft_model.model import StandaloneDraft
from speculators_train.families.objective import ChainAccuracy, Objective, Sums, global_counts, key, ratio
from speculators_train.head import TargetHead, logit_transform


def draft_model_loss(
    draft: StandaloneDraft, batch: dict[str, torch.Tensor], head: TargetHead, kind: Divergence, across_ranks: bool
) -> tuple[torch.Tensor, Sums]:
    """The divergence is computed over chunks of positions (`chunks.chunked`): neither the target's nor the draft's
    whole-vocabulary logits of a long sample exist at once, in the forward or the backward pass."""
    ids, final, mask = batch["input_ids"], batch["hidden_state"], batch["loss_mask"]
    length = ids.shape[1] - 1
    lengths = batch.get("lengths")  # right padding, where a collated batch has any
    attention = None if lengths is None else (torch.arange(length, device=ids.device)[None] < lengths[:, None]).long()
    body = text_decoder(draft.lm)
    hidden = body(input_ids=ids[:, :-1], attention_mask=attention, use_cache=False).last_hidden_state  # [B, L, H]
    out_head, transform = draft.lm.get_output_embeddings(), logit_transform(draft.lm.config)
    trained = mask[:, 1:]

    def piece(h: torch.Tensor, y: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            target_logits = head(y.to(head.lm_head.weight.dtype)).float()  # [B, c, V]
            p = torch.softmax(target_logits, dim=-1)
        logits = transform(out_head(h)).float()
        per_position = divergence(p, torch.log_softmax(logits, dim=-1), kind)
        return (per_position * m).sum(), logits.argmax(-1) == target_logits.argmax(-1)

    rows = chunk_rows(ids.shape[0], out_head.weight.shape[0])
    total, right = chunked(piece, rows, hidden, final[:, :-1], trained)
    count = trained.sum()
    denominator = global_counts(count[None])[0] if across_ranks else count.clamp(min=1)
    sums: Sums = {"vocab_coverage": ratio(count, count), key("loss", 0): ratio(total, count)}
    sums.update(ChainAccuracy().step(0, right & trained, trained))
    return total / denominator, sums


class DraftModelObjective(Objective):
    metric_names = ("loss", "full_acc", "cond_acc")
    steps = 1

    def __init__(self, draft: StandaloneDraft, head: TargetHead, kind: Divergence) -> None:
        super().__init__(draft, head)
        self.kind = kind

    def forward(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Sums]:
        return draft_model_loss(self.draft, batch, self.head, self.kind, self.training)
