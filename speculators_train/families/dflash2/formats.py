"""The format engines load a DFlash2 draft from: speculators' DFlash2DraftModel, which vLLM serves as `method: dflash`
with the `DFlash2DraftModel` architecture.

    config.json         DFlash's keys with speculators_model_type "dflash2", architectures ["DFlash2DraftModel"],
                        conv_kernel_size, conv_group_size, selector_rank, selector_top_k,
                        speculators_config {algorithm "dflash2"}
    model.safetensors   DFlash's tensors (lm_head over the whole vocabulary, no d2t), layers.N.{attention_conv,
                        mlp_conv}.{base_kernel, kernel_projection.weight}, candidate_selector.{predecessor_codebook,
                        successor_codebook, hidden_projection.weight}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from speculators_train.families.block.formats import DFlashFormat, load_dflash
from speculators_train.families.dflash2.model import OPTIONS, DFlash2Draft, checked_dflash2_config
from speculators_train.families.format_common import proposal_config

KEYS = {name: name for name in OPTIONS}  # the file spells each option as the config does


class DFlash2Format(DFlashFormat):
    engines = "vLLM (`vllm serve`, `method: dflash`, GPU builds) and the `speculators` library"

    def detect(self, config: dict[str, Any]) -> bool:
        return config.get("speculators_model_type") == "dflash2"

    def read(self, path: Path, config: dict[str, Any], target_num_layers: int) -> tuple[DFlash2Draft, bool]:
        return load_dflash(path, config, target_num_layers, KEYS, (DFlash2Draft, checked_dflash2_config))

    def write(
        self, draft: DFlash2Draft, dtype: str, verifier: str, architectures: list[str], k: int
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        config, tensors = super().write(draft, dtype, verifier, architectures, k)
        config.update(
            architectures=["DFlash2DraftModel"],
            speculators_model_type="dflash2",
            speculators_config=proposal_config("dflash2", k, verifier, architectures),
            **{key: getattr(draft.config, field) for field, key in KEYS.items()},
        )
        return config, tensors
