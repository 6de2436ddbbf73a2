"""The layout engines load a P-EAGLE draft from: speculators' PEagleSpeculator, which vLLM serves with parallel
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

import json
import shlex
from pathlib import Path
from typing import Any

import torch

from speculators_train.errors import UserError
from speculators_train.families.base import Layout
from speculators_train.families.eagle3.formats import clean_layer_config, speculators_config
from speculators_train.families.layouts import dict_field, export_tensors, load_checked, proposal_config, read_weights
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
    tensors = export_tensors(draft, dtype, skip=("mask_embedding",))
    tensors["embed_tokens.weight"] = draft.embedding_table().to(tensors["fc.weight"].dtype).contiguous()
    return tensors


def load_peagle(path: Path, config: dict[str, Any], target_num_layers: int) -> tuple[PEagleDraft, bool]:
    config_file = path / "config.json"
    with reading(config_file, "P-EAGLE speculators config"):
        if config.get("fc_norm"):
            raise UserError(f"{config_file}: fc_norm is set; this draft class has no norm per target state")
        if config.get("mask_token_id") is None:
            raise UserError(f"{config_file}: mask_token_id is missing; vLLM refuses such a P-EAGLE draft too")
        layer = dict_field(config, "transformer_layer_config")
        n = target_num_layers
        aux = config.get("eagle_aux_hidden_state_layer_ids")
        methods = (config.get("speculators_config") or {}).get("proposal_methods") or [{}]
        cfg = checked_peagle_config(
            {
                "layer_config": clean_layer_config(layer),
                "target_hidden_size": config.get("target_hidden_size"),
                "draft_vocab_size": config.get("draft_vocab_size"),
                "aux_layer_ids": [2, n // 2, n - 3] if aux is None else aux,
                "norm_before_residual": config.get("norm_before_residual", True),  # missing: true, as vLLM reads it
                "norm_before_fc": config.get("norm_before_fc", False),
                "norm_output": config.get("norm_output", False),
                "mask_token_id": config["mask_token_id"],
                # speculators' trainer writes its depth count as the proposal's speculative tokens
                "depths": config.get("num_depths", methods[0].get("speculative_tokens", 8)),
            },
            {
                "layer_config": "transformer_layer_config",
                "aux_layer_ids": "eagle_aux_hidden_state_layer_ids",
                "depths": "num_depths",
            },
        )
    weights, source = read_weights(path)
    embedding = weights.get("embed_tokens.weight")
    if embedding is None or "mask_hidden" not in weights:
        missing = [name for name in ("embed_tokens.weight", "mask_hidden") if name not in weights]
        raise UserError(f"{source}: a P-EAGLE draft ships {' and '.join(missing)}; these weights do not")
    if embedding.dim() == 2 and cfg.mask_token_id < embedding.shape[0]:
        weights = {**weights, "mask_embedding": embedding[cfg.mask_token_id]}
    if "d2t" not in weights and cfg.draft_vocab_size == cfg.target_vocab_size:
        weights = {**weights, "d2t": torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)}
    draft = load_checked(lambda: PEagleDraft(cfg), weights, source, config_file)
    return draft, True


class PEagleLayout(Layout):
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

    def commands(self, out: Path, verifier: str, ev: Any, k: int) -> list[str]:
        spec = {"model": str(out), "method": "eagle3", "parallel_drafting": True, "num_speculative_tokens": k}
        return [
            f"vllm serve {shlex.quote(str(out))}",
            f"vllm serve {verifier} --speculative-config '{json.dumps(spec)}'",
        ]
