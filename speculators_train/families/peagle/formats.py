"""The format engines load a P-EAGLE draft from: speculators' PEagleSpeculator, which vLLM serves with parallel
drafting (written and read back here).

    config.json         as the EAGLE-3 speculators config, with speculators_model_type "peagle",
                        architectures ["PEagleSpeculator"], mask_token_id, num_depths (the depths trained),
                        embed_requires_grad true, and speculators_config.algorithm "peagle"
    model.safetensors   the EAGLE-3 weights, plus `mask_hidden` [1, 1, A*H_target] and `embed_tokens` (the target's
                        rows with the trained mask row): a P-EAGLE draft always ships its embedding

vLLM maps "peagle" to its EAGLE-3 method with `parallel_drafting: true` (`mask_token_id` becomes its
`pard_token`; it refuses a config without one and weights without `mask_hidden`) and builds the draft as
`Eagle3LlamaForCausalLM`, Llama-type layers. llama.cpp and SGLang have no P-EAGLE runtime.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from speculators_train.errors import UserError
from speculators_train.families.base import ExportFormat
from speculators_train.families.eagle.speculators import load_eagle3, speculators_config, speculators_fields
from speculators_train.families.format_common import (
    export_tensors,
    identity_vocab_maps,
    proposal_config,
    read_weights,
    shell_arg,
    vllm_serve,
)
from speculators_train.families.peagle.model import PEagleConfig, PEagleDraft, checked_peagle_config
from speculators_train.loading import reading

ARCHITECTURE = "PEagleSpeculator"


def peagle_config(config: PEagleConfig, verifier: str, architectures: list[str], k: int, dtype: str) -> dict[str, Any]:
    return {
        **speculators_config(config, verifier, architectures, k, dtype),
        "architectures": [ARCHITECTURE],
        "speculators_model_type": "peagle",
        "mask_token_id": config.mask_token_id,
        "num_depths": config.depths,
        "embed_requires_grad": True,  # the mask row is trained, so the file's embedding is the one to use
        "speculators_config": proposal_config("peagle", k, verifier, architectures),
    }


def peagle_tensors(draft: PEagleDraft, dtype: str) -> dict[str, torch.Tensor]:
    tensors = export_tensors(draft, dtype, skip=("mask_embedding", *identity_vocab_maps(draft)))
    tensors["embed_tokens.weight"] = draft.embedding_table().to(tensors["fc.weight"].dtype).contiguous()
    return tensors


def load_peagle(path: Path, config: dict[str, Any], target_num_layers: int) -> tuple[PEagleDraft, bool]:
    config_file = path / "config.json"
    with reading(config_file, "P-EAGLE speculators config"):
        if config.get("mask_token_id") is None:
            raise UserError(f"{config_file}: mask_token_id is missing; vLLM refuses such a P-EAGLE draft too")
        values, keys = speculators_fields(config, config_file, target_num_layers)
        methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
        values["mask_token_id"] = config["mask_token_id"]
        # speculators' trainer writes its depth count as the proposal's speculative tokens
        values["depths"] = config.get("num_depths", methods[0].get("speculative_tokens", 8))
        cfg = checked_peagle_config(values, {**keys, "depths": "num_depths"})
    weights, source = read_weights(path)
    embedding = weights.get("embed_tokens.weight")
    if embedding is None or "mask_hidden" not in weights:
        missing = [name for name in ("embed_tokens.weight", "mask_hidden") if name not in weights]
        raise UserError(f"{source}: a P-EAGLE draft ships {' and '.join(missing)}; these weights do not")
    if embedding.dim() == 2 and cfg.mask_token_id < embedding.shape[0]:  # else the shape check names the embedding
        weights = {**weights, "mask_embedding": embedding[cfg.mask_token_id]}
    return load_eagle3(cfg, weights, source, config_file, draft_type=PEagleDraft)


class PEagleFormat(ExportFormat):
    name = "speculators"
    engines = "vLLM (`vllm serve`, parallel drafting) and the `speculators` library"

    def detect(self, config: dict[str, Any]) -> bool:
        return config.get("speculators_model_type") == "peagle"

    def read(self, path: Path, config: dict[str, Any], target_num_layers: int) -> tuple[PEagleDraft, bool]:
        return load_peagle(path, config, target_num_layers)

    def write(
        self, draft: PEagleDraft, dtype: str, verifier: str, architectures: list[str], k: int
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return peagle_config(draft.config, verifier, architectures, k, dtype), peagle_tensors(draft, dtype)

    def vllm_speculative_config(self, out: Path, k: int) -> dict[str, Any]:
        return {"model": str(out), "method": "eagle3", "parallel_drafting": True, "num_speculative_tokens": k}

    def commands(self, out: Path, verifier: str, ev: Any, k: int) -> list[str]:
        return [f"vllm serve {shell_arg(out)}", vllm_serve(verifier, self.vllm_speculative_config(out, k))]
