"""The alignment of stored states and labels an EAGLE-shaped objective trains on (EAGLE-3's TTT and P-EAGLE's depths).

Alignment (T tokens from the generator; g = aux states, y = pre-norm final states, l = loss mask):

    tokens   [x0  x1  x2  x3 ...]      index j of the shifted batch holds
    aux      [g0  g1  g2  g3 ...]        token x_{j+1}, fused state g_j, RoPE position j+1,
    final    [y0  y1  y2  y3 ...]        target distribution from y_{j+1} (it predicts x_{j+2}),
    mask     [l0  l1  l2  l3 ...]        mask l_{j+2}: the mask of the token being predicted.

Positions whose target top-1 is outside the draft vocabulary are not `valid`. The target's distribution is not
materialised here: a loss computes it over chunks of positions from `final` (`TargetHead.on`, over the draft
vocabulary's rows `weight`), so no [B, L, vocabulary] tensor of a long sample exists at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from speculators_train.families.eagle.model import Eagle3Draft
from speculators_train.families.vocab import draft_to_target
from speculators_train.head import TargetHead


@dataclass
class Aligned:
    tokens: torch.Tensor  # [B, L] x_{j+1}
    aux: torch.Tensor  # [B, L, A*H] g_j
    positions: torch.Tensor  # [B, L] j+1
    final: torch.Tensor  # [B, L, H] y_{j+1}: the target state whose distribution index j is trained toward
    weight: torch.Tensor  # [draft_vocab, H] the target's lm_head rows of the draft vocabulary
    trained: torch.Tensor  # [B, L] bool: the predicted token is an assistant token (loss mask l_{j+2})
    valid: torch.Tensor  # [B, L] bool: trained, and the target's top-1 is in the draft vocab

    def target_probs(self, head: TargetHead, final: torch.Tensor) -> torch.Tensor:
        """The target's distribution over the draft vocabulary at the states `final` (a chunk of `self.final`)."""
        with torch.no_grad():
            return torch.softmax(head.on(final, self.weight), dim=-1)


def align(batch: dict[str, torch.Tensor], head: TargetHead, draft: Eagle3Draft) -> Aligned:
    ids, aux, final, mask = batch["input_ids"], batch["aux_hidden_states"], batch["hidden_state"], batch["loss_mask"]
    length = ids.shape[1] - 1
    predicted_mask = F.pad(mask[:, 2:], (0, 1), value=False)  # l_{j+2}
    with torch.no_grad():
        in_vocab = draft.t2d[head.greedy(final[:, 1:])]
        weight = head.lm_head.weight[draft_to_target(draft.d2t)]
    positions = torch.arange(1, length + 1, device=ids.device).expand(ids.shape[0], -1)
    return Aligned(ids[:, 1:], aux[:, :-1], positions, final[:, 1:], weight, predicted_mask, predicted_mask & in_vocab)
