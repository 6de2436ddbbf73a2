"""The format vLLM's `MLPSpeculator` loads (`MLPSpeculatorConfig`, model_type "mlp_speculator"):

    config.json         architectures ["MLPSpeculatorPreTrainedModel"], emb_dim, inner_dim, n_predict,
                        top_k_tokens_per_head ([1] per stage: chains), n_candidates 1, vocab_size, tie_weights,
                        scale_input, speculators_train {target_num_layers}
    model.safetensors   emb.{i}.weight, proj.{i}.weight, ln.{i}.weight/.bias, head.{i}.weight; with tie_weights
                        the shared tensors once, under their first index (emb.0, proj.1, ln.0), as vLLM's
                        deduplicated parameter names read them

vLLM's loader drops a `speculator.` prefix (IBM's files carry one) and so does the reader here. vLLM 0.32 loads
this class but no longer serves the method: its V1 engine has no MLP proposer (`mlp_speculator` is listed as
unsupported and the model runner has no branch for it); releases with the V0 engine (up to 0.10) serve it with
`--speculative-config '{"model": <dir>}'`, the method read from model_type.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers

from speculators_train.families.base import ExportFormat
from speculators_train.families.format_common import dict_field, export_tensors, load_checked, read_weights, vllm_serve
from speculators_train.families.mlp.model import MLPConfig, MLPDraft, checked_config
from speculators_train.loading import reading

ARCHITECTURE = "MLPSpeculatorPreTrainedModel"


def speculator_config(config: MLPConfig, dtype: str) -> dict[str, Any]:
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "mlp_speculator",
        "emb_dim": config.emb_dim,
        "inner_dim": config.inner_dim,
        "n_predict": config.n_predict,
        "top_k_tokens_per_head": [1] * config.n_predict,
        "n_candidates": 1,
        "vocab_size": config.vocab_size,
        "tie_weights": config.tie_weights,
        "scale_input": config.scale_input,
        "speculators_train": {"target_num_layers": config.target_num_layers},
        "torch_dtype": dtype,
        "transformers_version": transformers.__version__,
    }


def load_speculator(path: Path, config: dict[str, Any]) -> MLPDraft:
    config_file = path / "config.json"
    with reading(config_file, "MLP speculator config"):
        ours = dict_field(config, "speculators_train", default={})
        cfg = checked_config(
            {**{k: config.get(k) for k in ("emb_dim", "inner_dim", "n_predict", "vocab_size")},
             "tie_weights": config.get("tie_weights", False), "scale_input": config.get("scale_input", False),
             "target_num_layers": ours.get("target_num_layers", 0)},
            {"target_num_layers": "speculators_train.target_num_layers"},
        )  # fmt: skip
    weights, source = read_weights(path)
    weights = {name.replace("speculator.", ""): tensor for name, tensor in weights.items()}
    return load_checked(lambda: MLPDraft(cfg), weights, source, config_file)


class MLPSpeculatorFormat(ExportFormat):
    name = "vllm"
    engines = "vLLM's `MLPSpeculator` (served by releases with the V0 engine, up to 0.10)"

    def detect(self, config: dict[str, Any]) -> bool:
        return config.get("model_type") == "mlp_speculator"

    def read(self, path: Path, config: dict[str, Any], target_num_layers: int) -> tuple[MLPDraft, bool]:
        return load_speculator(path, config), True

    def write(
        self, draft: MLPDraft, dtype: str, verifier: str, architectures: list[str], k: int
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return speculator_config(draft.config, dtype), export_tensors(draft, dtype)

    def commands(self, out: Path, verifier: str, ev: Any, k: int) -> list[str]:
        """For a vLLM release with the V0 engine: it reads the method from model_type."""
        return [vllm_serve(verifier, {"model": str(out), "num_speculative_tokens": k})]
