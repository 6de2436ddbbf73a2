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

import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import LlamaConfig

from speculators_train.errors import UserError
from speculators_train.families.base import ExportFormat
from speculators_train.families.eagle3.model import Eagle3Config, Eagle3Draft, check_layer, checked_config
from speculators_train.families.eagle3.settings import SGLANG_LACKS
from speculators_train.families.format_common import (
    SPECULATORS_VERSION,
    dict_field,
    export_tensors,
    load_checked,
    proposal_config,
    read_weights,
    shown,
    vllm_serve,
)
from speculators_train.loading import reading

ARCHITECTURE = "LlamaForCausalLMEagle3"  # SGLang's
# LlamaConfig.to_dict() keys that describe a saved file rather than the layer.
_FILE_KEYS = ("transformers_version", "dtype", "torch_dtype", "_name_or_path", "architectures")


def layer_config(config: Eagle3Config) -> dict[str, Any]:
    """The full LlamaConfig dict of the single decoder layer, as engines rebuild it: RoPE both nested
    (`rope_parameters`, newer vLLM) and flat (`rope_theta`, and `rope_scaling` unless default), which older vLLM
    and SGLang read, falling back to theta 10000 without them."""
    layer = LlamaConfig(**config.layer_config).to_dict()
    for key in _FILE_KEYS:
        layer.pop(key, None)
    layer.update(model_type="llama", num_hidden_layers=1, tie_word_embeddings=False)
    rope = layer.get("rope_parameters") or {}
    if "rope_theta" in rope:
        layer["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default":
        layer["rope_scaling"] = dict(rope)
    return layer


def speculators_config(
    config: Eagle3Config, verifier: str, verifier_architectures: list[str], speculative_tokens: int, dtype: str
) -> dict[str, Any]:
    """config.json as `speculators` 0.9.0 writes it for EAGLE-3 (no top-level model_type: vLLM detects the
    format from `speculators_model_type`)."""
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": {**layer_config(config), "architectures": ["LlamaForCausalLM"]},
        "draft_vocab_size": config.draft_vocab_size,
        "norm_before_residual": config.norm_before_residual,  # always written: vLLM reads a missing key as true
        "target_hidden_size": config.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(config.aux_layer_ids),
        "norm_before_fc": config.norm_before_fc,
        "fc_norm": False,
        "norm_output": config.norm_output,
        "embed_requires_grad": False,
        "speculators_config": proposal_config("eagle3", speculative_tokens, verifier, verifier_architectures),
        "dtype": dtype,
        "transformers_version": transformers.__version__,
    }


def speculators_fields(
    config: dict[str, Any], config_file: Path, target_num_layers: int
) -> tuple[dict[str, Any], dict[str, str]]:
    """The Eagle3Config fields a speculators-format config.json describes (to be checked by `checked_config`), and
    how the file spells those that it names differently. Call inside `reading(config_file, ...)`."""
    layer = dict_field(config, "transformer_layer_config")
    if config.get("fc_norm"):
        raise UserError(f"{config_file}: fc_norm is set; this draft class has no norm per target state")
    n = target_num_layers
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    values = {
        "layer_config": clean_layer_config(layer),
        "target_hidden_size": config.get("target_hidden_size"),
        "draft_vocab_size": config.get("draft_vocab_size"),
        "aux_layer_ids": [2, n // 2, n - 3] if aux is None else aux,
        "norm_before_residual": config.get("norm_before_residual", True),  # missing: true, as vLLM reads it
        "norm_before_fc": config.get("norm_before_fc", False),
        "norm_output": config.get("norm_output", False),
    }
    return values, {"layer_config": "transformer_layer_config", "aux_layer_ids": "eagle_aux_hidden_state_layer_ids"}


def load_speculators_eagle3(path: Path, config: dict[str, Any], target_num_layers: int) -> tuple[Eagle3Draft, bool]:
    """A draft from a speculators-format directory, and whether the file carried `embed_tokens` (vLLM then keeps
    it); if not, the caller fills the embedding from the target."""
    config_file = path / "config.json"
    with reading(config_file, "EAGLE-3 speculators config"):
        cfg = checked_config(*speculators_fields(config, config_file, target_num_layers))
    weights, source = read_weights(path)
    return load_eagle3(cfg, weights, source, config_file)


def clean_layer_config(layer: dict[str, Any]) -> dict[str, Any]:
    """A layer config read from someone's file, reduced to what rebuilds one Llama decoder layer."""
    layer = dict(layer)
    for key in (*_FILE_KEYS, "model_type", "layer_types", "mlp_layer_types"):
        layer.pop(key, None)
    layer.update(num_hidden_layers=1, tie_word_embeddings=False)
    return layer


def load_eagle3(
    config: Eagle3Config,
    weights: dict[str, torch.Tensor],
    source: Path,
    config_file: Path,
    spell: Callable[[str], str] = str,
    draft_type: type[Eagle3Draft] = Eagle3Draft,
) -> tuple[Eagle3Draft, bool]:
    """The draft (`draft_type`, an Eagle3Draft or a draft extending it) holding `weights` (names in our = the
    speculators format; `spell` gives the file's) once they fit `config`, and whether they carried `embed_tokens`.
    A full-vocabulary draft may ship no d2t: its map is the identity."""
    if "d2t" not in weights and config.draft_vocab_size == config.target_vocab_size:
        weights = {**weights, "d2t": torch.zeros(config.draft_vocab_size, dtype=torch.int64)}
    draft = load_checked(
        lambda: draft_type(config), weights, source, config_file, optional=("embed_tokens.weight",), spell=spell
    )
    return draft, "embed_tokens.weight" in weights


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
        return speculators_config(draft.config, verifier, architectures, k, dtype), export_tensors(draft, dtype)

    def vllm_speculative_config(self, out: Path, k: int) -> dict[str, Any]:
        return {"model": str(out), "method": "eagle3", "num_speculative_tokens": k}

    def commands(self, out: Path, verifier: str, ev: Any, k: int) -> list[str]:
        return [f"vllm serve {shlex.quote(str(out))}", vllm_serve(verifier, self.vllm_speculative_config(out, k))]


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

    def commands(self, out: Path, verifier: str, ev: Any, k: int) -> list[str]:
        if ev.mode == "tree":
            steps, topk, tokens = ev.tree.depth, ev.tree.top_k, ev.tree.budget + 1
        else:
            steps, topk, tokens = k, 1, k + 1
        return [
            f"python -m sglang.launch_server --model-path {shlex.quote(verifier)} --speculative-algorithm EAGLE3 "
            f"--speculative-draft-model-path {shlex.quote(str(out))} --speculative-num-steps {steps} "
            f"--speculative-eagle-topk {topk} --speculative-num-draft-tokens {tokens}"
        ]
