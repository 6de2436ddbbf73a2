"""The format engines load a standalone draft from: a plain model folder, as `save_pretrained` writes it.

    config.json         the draft LM's config (the target's text model type, architectures ["<Type>ForCausalLM"],
                        tie_word_embeddings false)
    model.safetensors   model.embed_tokens, model.layers.*, model.norm, lm_head (transformers' names)
    tokenizer files     the target's, with its chat template (`export` writes them beside every format)

vLLM serves it as `{"method": "draft_model", "model": <folder>}`, SGLang as `--speculative-algorithm STANDALONE`.
The `gguf` format is the same folder plus `draft.gguf`, made from it by llama.cpp's own converter, which
`llama-server -md` runs as a plain draft model (`--spec-type draft-simple`: `engines.llamacpp.server`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from speculators_train.engines.llamacpp.converter import OUTTYPES, convert
from speculators_train.engines.llamacpp.server import PLAIN_LM
from speculators_train.families.base import ExportFormat
from speculators_train.families.draft_model.model import StandaloneDraft, checked_config, lm_values
from speculators_train.families.format_common import (
    GGUFDraft,
    export_tensors,
    load_checked,
    read_weights,
    sglang_serve,
    vllm_serve,
)
from speculators_train.loading import reading

PREFIX = "lm."  # the module's names are the LM's under `lm`


def folder_config(draft: StandaloneDraft, dtype: str) -> dict[str, Any]:
    return {**draft.config.model_config, "architectures": [type(draft.lm).__name__], "torch_dtype": dtype}


def is_model_folder(config: dict[str, Any]) -> bool:
    """A plain causal-LM folder: one `*ForCausalLM` architecture of a model type transformers has one for, and no
    key of a speculators draft."""
    architectures = config.get("architectures")
    return (
        isinstance(architectures, list)
        and len(architectures) == 1
        and str(architectures[0]).endswith("ForCausalLM")
        and config.get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        and "speculators_model_type" not in config
    )


def load_folder(path: Path, config: dict[str, Any]) -> StandaloneDraft:
    config_file = path / "config.json"
    model = lm_values(config)
    with reading(config_file, "draft model config"):
        cfg = checked_config({"model_config": model, "target_vocab_size": model.get("vocab_size")})
    weights, source = read_weights(path)
    weights = {PREFIX + name: tensor for name, tensor in weights.items()}
    return load_checked(lambda: StandaloneDraft(cfg), weights, source, config_file, spell=lambda n: n[len(PREFIX) :])


class ModelFolderFormat(ExportFormat):
    name = "hf"
    engines = "vLLM (`method: draft_model`), SGLang (`STANDALONE`), llama.cpp (`-md`, after its converter)"

    def detect(self, config: dict[str, Any]) -> bool:
        return is_model_folder(config)

    def read(self, path: Path, config: dict[str, Any], target_num_layers: int) -> tuple[StandaloneDraft, bool]:
        return load_folder(path, config), True

    def write(
        self, draft: StandaloneDraft, dtype: str, verifier: str, architectures: list[str], k: int
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return folder_config(draft, dtype), export_tensors(draft, dtype, lambda n: n[len(PREFIX) :])

    def vllm_speculative_config(self, out: Path, k: int) -> dict[str, Any]:
        return {"model": str(out), "method": "draft_model", "num_speculative_tokens": k}

    def commands(self, out: Path, verifier: str, ev: Any, k: int) -> list[str]:
        sglang = sglang_serve(verifier, out, "STANDALONE", k, 1, k + 1)
        return [vllm_serve(verifier, self.vllm_speculative_config(out, k)), sglang]


class GGUFFormat(GGUFDraft, ModelFolderFormat):
    engines = "llama.cpp (`llama-server -md draft.gguf`)"
    draft_architecture = "llama"
    llamacpp_spec_type = PLAIN_LM

    def finish(self, out: Path, target_dir: Path, dtype: str) -> None:
        convert(out, out / self.draft_file, OUTTYPES[dtype])

    def vllm_speculative_config(self, out: Path, k: int) -> dict[str, Any] | None:
        return None  # vLLM serves the folder itself: export --format hf
