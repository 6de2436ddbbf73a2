"""The MLP speculator as a registered family: stages over the target's last state that each see the token drafted
before them, trained stage by stage against the target's distribution, exported in the layout vLLM loads."""

from __future__ import annotations

import torch

from speculators_train.families.base import DraftStart, Family
from speculators_train.families.mlp.model import MLPConfig, MLPDraft, checked_config
from speculators_train.families.mlp.objective import MLPObjective
from speculators_train.families.mlp.proposer import MLPProposer
from speculators_train.families.mlp.settings import Settings
from speculators_train.head import TargetHead


class MLPFamily(Family):
    name = "mlp"
    settings = Settings
    title = "MLP speculator"
    step_label = "stage"
    draft_type = MLPDraft
    config_type = MLPConfig
    config_reader = staticmethod(checked_config)
    proposer_type = MLPProposer

    def new_draft(self, settings: Settings, start: DraftStart) -> MLPDraft:
        """Stages at the target's width start with the target's output layer as every head and as the token
        embedding (a stage then begins as the target's own next-token guess); narrower ones start at random."""
        text = start.target_config.get_text_config()
        config = checked_config(
            {
                "emb_dim": text.hidden_size,
                "inner_dim": settings.inner_dim,
                "n_predict": settings.n_predict,
                "vocab_size": text.vocab_size,
                "tie_weights": settings.tie_weights,
                "scale_input": settings.scale_input,
                "target_num_layers": text.num_hidden_layers,
            }
        )
        draft = MLPDraft(config)
        with torch.no_grad():
            for module in draft.modules():
                if isinstance(module, torch.nn.Linear):
                    torch.nn.init.normal_(module.weight, std=module.in_features**-0.5)
                elif isinstance(module, torch.nn.Embedding):
                    torch.nn.init.normal_(module.weight, std=config.inner_dim**-0.5)
            if config.inner_dim == config.emb_dim:
                rows = start.head["lm_head"].to(torch.float32)
                for stage in draft.head:
                    stage.weight.copy_(rows)
                for emb in draft.emb:
                    emb.weight.copy_(rows)
        return draft

    def attach_target(self, draft: MLPDraft, embed_weight: torch.Tensor, has_embedding: bool) -> None:
        """The stages own their embeddings and heads."""

    def objective(
        self,
        draft: MLPDraft,
        head: TargetHead,
        settings: Settings,
        depth: int | None = None,
        divergence: str | None = None,
    ) -> MLPObjective:
        """Every stage is scored whatever `depth`."""
        return MLPObjective(draft, head, settings.stage_decay, divergence or settings.loss)

    def max_draft_tokens(self, draft: MLPDraft) -> int:
        return draft.config.n_predict

    def card_rows(self, draft: MLPDraft, fmt: str, k: int) -> list[tuple[str, str]]:
        cfg = draft.config
        return [
            ("target states read", "the last decoder layer's output after the final norm"),
            ("stages", f"{cfg.n_predict} (stage i proposes the token i+2 after the last verified one)"),
            ("inner width / tied stages", f"{cfg.inner_dim} / {'yes' if cfg.tie_weights else 'no'}"),
            ("vocabulary", f"the target's {cfg.vocab_size} ids"),
            ("speculative tokens", str(k)),
        ]


FAMILY = MLPFamily()
