"""The format engines load a DSpark draft from: speculators' DSparkDraftModel, which vLLM serves as `method: dspark`
and llama.cpp's converter reads (written and read back here).

    config.json         DFlash's keys (`families/block/formats.py`) with speculators_model_type "dspark",
                        architectures ["DSparkSpeculator"] (the name speculators writes, and the one llama.cpp's
                        converter registers), sample_from_anchor true, markov_rank, markov_head_type,
                        enable_confidence_head, confidence_head_with_markov (always written: vLLM reads a missing
                        flag as false where speculators reads it as true), speculators_config {algorithm "dspark"}
    model.safetensors   DFlash's tensors, markov_head.markov_w1.weight [target vocab, r], markov_head.markov_w2.weight
                        [draft vocab, r] (+ gate_proj / joint_proj), confidence_head.proj.{weight, bias}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from speculators_train.families.block.formats import DFlashFormat, load_dflash
from speculators_train.families.dspark.model import DSparkDraft, checked_dspark_config
from speculators_train.families.format_common import proposal_config

ARCHITECTURE = "DSparkSpeculator"
HEADS = {  # our config field -> the file's key
    "markov_rank": "markov_rank",
    "markov_head_type": "markov_head_type",
    "confidence_head": "enable_confidence_head",
    "confidence_head_with_markov": "confidence_head_with_markov",
}


class DSparkFormat(DFlashFormat):
    engines = "vLLM (`vllm serve`, `method: dspark`) and the `speculators` library"

    def detect(self, config: dict[str, Any]) -> bool:
        return config.get("speculators_model_type") == "dspark"

    def read(self, path: Path, config: dict[str, Any], target_num_layers: int) -> tuple[DSparkDraft, bool]:
        return load_dflash(path, config, target_num_layers, HEADS, (DSparkDraft, checked_dspark_config))

    def write(
        self, draft: DSparkDraft, dtype: str, verifier: str, architectures: list[str], k: int
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        config, tensors = super().write(draft, dtype, verifier, architectures, k)
        cfg = draft.config
        config.update(
            architectures=[ARCHITECTURE],
            speculators_model_type="dspark",
            sample_from_anchor=True,
            speculators_config=proposal_config("dspark", k, verifier, architectures),
            **{key: getattr(cfg, field) for field, key in HEADS.items()},
        )
        return config, tensors

    def vllm_speculative_config(self, out: Path, k: int) -> dict[str, Any]:
        return {"model": str(out), "method": "dspark", "num_speculative_tokens": k}
