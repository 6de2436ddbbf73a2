"""The two formats engines load an EAGLE-3 draft from, each written and read back here.

speculators / vLLM (`vllm serve <dir>`; also what the `speculators` library loads):

    config.json         speculators_model_type "eagle3", transformer_layer_config (a LlamaConfig dict),
                        draft_vocab_size, norm_before_residual, norm_before_fc, norm_output, target_hidden_size,
                        eagle_aux_hidden_state_layer_ids, speculators_config {...}
    model.safetensors   fc, [input_norm], layers.0.*, norm, lm_head, [embed_tokens], d2t (int64), t2d (bool); no
                        `model.` prefix

    EAGLE-3.1's switches are written as trained: `norm_before_fc` (vLLM and llama.cpp's converter build
    `input_norm` from it) and `norm_output` (vLLM feeds the post-norm output back; llama.cpp ignores it, so the
    gguf format refuses such a draft). `fc_norm` (a norm per target state) is not trained here: always false.

    Aux layer ids there count like ours and vLLM's (id k = the residual stream entering layer k). A missing
    `norm_before_residual` means true, as vLLM reads it.

SGLang / original EAGLE (SGLang's `LlamaForCausalLMEagle3`, SpecForge):

    config.json         a flat LlamaConfig: architectures ["LlamaForCausalLMEagle3"], draft_vocab_size,
                        target_hidden_size, tie_word_embeddings false,
                        eagle_config {eagle_aux_hidden_state_layer_ids, use_aux_hidden_state} (SGLang's ids),
                        eagle_aux_hidden_state_layer_ids (ours, unshifted: what vLLM and llama.cpp read)
    model.safetensors   fc, midlayer.* (where we write layers.0.*), norm, lm_head, embed_tokens, d2t, t2d

    What SGLang does with it, and why the writer refuses some drafts:
    - it loads a name it does not know by skipping it, so a wrong name runs a random layer instead of failing;
    - its decoder layer keeps the un-normalised hidden state as the residual: `norm_before_residual: false` only;
    - its `fc` takes exactly 3 target states;
    - it captures `id + 1` for each id in `eagle_config`: SGLang counts "the output of layer id", we (and vLLM)
      count "the residual stream entering layer id". Our id k is written as k - 1, so id 0 (the embeddings)
      cannot be.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig

from speculators_train.families.base import ExportFormat
from speculators_train.families.eagle.model import Eagle3Config, Eagle3Draft, check_layer, checked_config
from speculators_train.families.eagle.speculators import (
    clean_layer_config,
    layer_config,
    load_eagle3,
    speculators_config,
    speculators_fields,
)
from speculators_train.families.eagle3.settings import SGLANG_LACKS
from speculators_train.families.format_common import (
    dict_field,
    export_tensors,
    identity_vocab_maps,
    read_weights,
    sglang_serve,
    shell_arg,
    shown,
    vllm_serve,
)
from speculators_train.loading import reading

ARCHITECTURE = "LlamaForCausalLMEagle3"  # SGLang's


def load_speculators_eagle3(path: Path, config: dict[str, Any], target_num_layers: int) -> tuple[Eagle3Draft, bool]:
    """A draft from a speculators-format directory, and whether the file carried `embed_tokens` (vLLM then keeps
    it); if not, the caller fills the embedding from the target."""
    config_file = path / "config.json"
    with reading(config_file, "EAGLE-3 speculators config"):
        cfg = checked_config(*speculators_fields(config, config_file, target_num_layers))
    weights, source = read_weights(path)
    return load_eagle3(cfg, weights, source, config_file)


def unsupported(config: Eagle3Config) -> list[str]:
    """Why SGLang could not run this draft as trained (empty when it can)."""
    out = [
        f"{flag} is true, but SGLang's LlamaForCausalLMEagle3 {what} (it would draft wrong tokens); export "
        f"--format speculators for vLLM, or train with draft.{flag}: false"
        for flag, what in SGLANG_LACKS.items()
        if getattr(config, flag)
    ]
    if len(config.aux_layer_ids) != 3:
        out.append(f"SGLang's fc takes exactly 3 target states; this draft reads {len(config.aux_layer_ids)}")
    if min(config.aux_layer_ids) < 1:
        out.append(f"aux layer ids {config.aux_layer_ids} include the embeddings (0), which SGLang cannot capture")
    return out


def sglang_config(config: Eagle3Config, dtype: str) -> dict[str, Any]:
    """SGLang reads the ids in `eagle_config` (shifted: its id i is our i + 1); vLLM and llama.cpp's converter read
    the top-level key, unshifted, so both are written."""
    return {
        **layer_config(config),
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "tie_word_embeddings": False,  # true would make SGLang use the embedding as the draft-vocab lm_head
        "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in config.aux_layer_ids],
            "use_aux_hidden_state": True,
        },
        "torch_dtype": dtype,
    }


def sglang_reading(trained: Eagle3Config, config: dict[str, Any], n: int) -> list[tuple[str, Any, Any]]:
    """What SGLang's EAGLE-3 worker and LlamaForCausalLMEagle3 take from `config`, where it differs from `trained`:
    the target captures `val + 1` for each id in `eagle_config` (`set_eagle3_layers_to_capture`), or
    [2, n // 2, n - 3] without them; the flags it lacks run as false whatever the file says; a true
    `tie_word_embeddings` makes the embedding its lm_head."""
    eagle = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    captured = [2, n // 2, n - 3] if ids is None else [i + 1 for i in ids] if isinstance(ids, list) else ids
    read = {
        "aux layer ids (after k target layers)": (list(trained.aux_layer_ids), captured),
        "draft_vocab_size": (trained.draft_vocab_size, config.get("draft_vocab_size")),
        "lm_head": ("separate", "the embedding" if config.get("tie_word_embeddings") else "separate"),
        **{flag: (getattr(trained, flag), False) for flag in SGLANG_LACKS},
    }
    if ARCHITECTURE not in (config.get("architectures") or []):
        read["architectures"] = ([ARCHITECTURE], config.get("architectures"))
    return [(name, a, b) for name, (a, b) in read.items() if a != b]


def weight_name(name: str) -> str:
    """Our (speculators-format) weight name -> SGLang's."""
    return "midlayer." + name[len("layers.0.") :] if name.startswith("layers.0.") else name


def load_sglang_eagle3(path: Path, config: dict[str, Any], target_num_layers: int) -> tuple[Eagle3Draft, bool]:
    """A draft from an SGLang/EAGLE-format directory (ours or SpecForge's), and whether it carried `embed_tokens`."""
    config_file = path / "config.json"
    with reading(config_file, f"EAGLE-3 {ARCHITECTURE} config"):
        check_layer(config)  # before LlamaConfig reads the values
        known = set(LlamaConfig().to_dict())
        layer = {k: v for k, v in LlamaConfig(**config).to_dict().items() if k in known}
        eagle = dict_field(config, "eagle_config", default={})
        theirs = eagle.get("eagle_aux_hidden_state_layer_ids")
        if theirs is None:
            n = target_num_layers
            aux = [2, n // 2, n - 3]  # SGLang's default, already in our convention
        elif isinstance(theirs, list) and all(type(i) is int for i in theirs):
            aux = [i + 1 for i in theirs]
        else:
            raise ValueError(
                f"eagle_config.eagle_aux_hidden_state_layer_ids must be a list of integers, got {shown(theirs)}"
            )
        cfg = checked_config(
            {
                "layer_config": clean_layer_config(layer),
                "target_hidden_size": config.get("target_hidden_size"),
                "draft_vocab_size": config.get("draft_vocab_size"),
                "aux_layer_ids": aux,
                "norm_before_residual": False,  # the only convention SGLang runs
            },
            {"layer_config": "", "aux_layer_ids": "eagle_config.eagle_aux_hidden_state_layer_ids (each + 1)"},
        )
    weights, source = read_weights(path)
    renamed = {}
    for name, tensor in weights.items():
        name = name.removeprefix("model.")
        renamed["layers.0." + name[len("midlayer.") :] if name.startswith("midlayer.") else name] = tensor
    return load_eagle3(cfg, renamed, source, config_file, weight_name)


class SpeculatorsFormat(ExportFormat):
    name = "speculators"
    engines = "vLLM (`vllm serve`) and the `speculators` library"

    def detect(self, config: dict[str, Any]) -> bool:
        return config.get("speculators_model_type") == "eagle3"

    def read(self, path: Path, config: dict[str, Any], target_num_layers: int) -> tuple[Eagle3Draft, bool]:
        return load_speculators_eagle3(path, config, target_num_layers)

    def write(
        self, draft: Eagle3Draft, dtype: str, verifier: str, architectures: list[str], k: int
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        tensors = export_tensors(draft, dtype, skip=identity_vocab_maps(draft))
        return speculators_config(draft.config, verifier, architectures, k, dtype), tensors

    def vllm_speculative_config(self, out: Path, k: int) -> dict[str, Any]:
        return {"model": str(out), "method": "eagle3", "num_speculative_tokens": k}

    def commands(self, out: Path, verifier: str, ev: Any, k: int) -> list[str]:
        return [f"vllm serve {shell_arg(out)}", vllm_serve(verifier, self.vllm_speculative_config(out, k))]


class SGLangFormat(ExportFormat):
    name = "sglang"
    engines = "SGLang (EAGLE3)"

    def detect(self, config: dict[str, Any]) -> bool:
        architectures = config.get("architectures")
        return isinstance(architectures, list) and ARCHITECTURE in architectures

    def read(self, path: Path, config: dict[str, Any], target_num_layers: int) -> tuple[Eagle3Draft, bool]:
        return load_sglang_eagle3(path, config, target_num_layers)

    def write(
        self, draft: Eagle3Draft, dtype: str, verifier: str, architectures: list[str], k: int
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        return sglang_config(draft.config, dtype), export_tensors(draft, dtype, weight_name)

    def unsupported(self, draft: Eagle3Draft) -> list[str]:
        return unsupported(draft.config)

    def sglang_reading(
        self, draft: Eagle3Draft, config: dict[str, Any], target_num_layers: int
    ) -> list[tuple[str, Any, Any]]:
        return sglang_reading(draft.config, config, target_num_layers)

    def commands(self, out: Path, verifier: str, ev: Any, k: int) -> list[str]:
        if ev.mode == "tree":
            steps, topk, tokens = ev.tree.depth, ev.tree.top_k, ev.tree.budget + 1
        else:
            steps, topk, tokens = k, 1, k + 1
        return [sglang_serve(verifier, out, "EAGLE3", steps, topk, tokens)]
