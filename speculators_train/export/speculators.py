"""The speculators / vLLM EAGLE-3 layout (SPEC section 5): written for `vllm serve <dir>`, and read back into this
toolkit's draft class (also when another tool made it).

    config.json         speculators_model_type "eagle3", transformer_layer_config (a LlamaConfig dict),
                        draft_vocab_size, norm_before_residual, target_hidden_size,
                        eagle_aux_hidden_state_layer_ids, speculators_config {...}
    model.safetensors   fc, layers.0.*, norm, lm_head, [embed_tokens], d2t (int64), t2d (bool); no `model.` prefix

Aux layer ids there count like ours and vLLM's (id k = the residual stream entering layer k). A missing
`norm_before_residual` means true, as vLLM reads it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file
from transformers import LlamaConfig

from speculators_train.errors import UserError
from speculators_train.files import read_json
from speculators_train.models.eagle3 import Eagle3Config, Eagle3Draft

SPECULATORS_VERSION = "0.9.0"  # the format version written; vLLM 0.33 reads it
# LlamaConfig.to_dict() keys that describe a saved file rather than the layer.
_FILE_KEYS = ("transformers_version", "dtype", "torch_dtype", "_name_or_path", "architectures")


def layer_config(config: Eagle3Config) -> dict[str, Any]:
    """The full LlamaConfig dict of the single decoder layer, as engines rebuild it."""
    layer = LlamaConfig(**config.layer_config).to_dict()
    for key in _FILE_KEYS:
        layer.pop(key, None)
    layer.update(model_type="llama", num_hidden_layers=1, tie_word_embeddings=False)
    return layer


def proposal_config(
    algorithm: str, speculative_tokens: int, verifier: str, verifier_architectures: list[str]
) -> dict[str, Any]:
    """The `speculators_config` block: the algorithm, one greedy proposal method, and the verifier."""
    return {
        "algorithm": algorithm,
        "proposal_methods": [
            {
                "proposal_type": "greedy",
                "speculative_tokens": speculative_tokens,
                "verifier_accept_k": 1,
                "accept_tolerance": 0.0,
            }
        ],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
    }


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
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "speculators_config": proposal_config("eagle3", speculative_tokens, verifier, verifier_architectures),
        "dtype": dtype,
        "transformers_version": transformers.__version__,
    }


def is_speculators_eagle3(path: Path) -> bool:
    config = path / "config.json"
    return config.is_file() and read_json(config, "draft config").get("speculators_model_type") == "eagle3"


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = (
            f"; {pickled} are pickled, and this toolkit never unpickles checkpoint files: convert them to "
            "safetensors where you trust them"
            if pickled
            else ""
        )
        raise UserError(f"{path}: no .safetensors weights next to config.json{hint}")
    out: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            out.update(load_file(file))
        except OSError as exc:
            raise UserError(f"{file}: unreadable weights ({exc})") from None
    return out


def load_speculators_eagle3(path: Path, target_num_layers: int) -> tuple[Eagle3Draft, bool]:
    """A draft from a speculators-format directory, and whether the file carried `embed_tokens` (vLLM then keeps
    it); if not, the caller fills the embedding from the target."""
    config = read_json(path / "config.json", "draft config")
    layer = dict(config.get("transformer_layer_config") or {})
    missing = [key for key in ("hidden_size", "vocab_size", "num_attention_heads") if key not in layer]
    if missing or "draft_vocab_size" not in config:
        raise UserError(
            f"{path / 'config.json'}: not an EAGLE-3 speculators config (missing {missing or 'draft_vocab_size'})"
        )
    unsupported = [key for key in ("norm_before_fc", "fc_norm", "norm_output") if config.get(key)]
    if unsupported:
        raise UserError(f"{path / 'config.json'}: {unsupported} set; this draft class implements neither")
    n = target_num_layers
    aux = config.get("eagle_aux_hidden_state_layer_ids") or [2, n // 2, n - 3]
    draft = Eagle3Draft(
        Eagle3Config(
            layer_config=clean_layer_config(layer),
            target_hidden_size=config.get("target_hidden_size") or layer["hidden_size"],
            draft_vocab_size=int(config["draft_vocab_size"]),
            aux_layer_ids=list(aux),
            norm_before_residual=bool(config.get("norm_before_residual", True)),
        )
    )
    return draft, load_weights_into(draft, read_weights(path), path)


def clean_layer_config(layer: dict[str, Any]) -> dict[str, Any]:
    """A layer config read from someone's file, reduced to what rebuilds one Llama decoder layer."""
    layer = dict(layer)
    for key in (*_FILE_KEYS, "model_type", "layer_types", "mlp_layer_types"):
        layer.pop(key, None)
    layer.update(num_hidden_layers=1, tie_word_embeddings=False)
    return layer


def load_weights_into(draft: Eagle3Draft, weights: dict[str, torch.Tensor], path: Path) -> bool:
    """Load names in our (= the speculators) layout, with d2t/t2d kept integer/bool and an identity mapping for a
    full-vocab draft that ships none. Returns whether `embed_tokens` was in the files."""
    cfg = draft.config
    if "d2t" not in weights and cfg.draft_vocab_size == cfg.target_vocab_size:
        weights["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
    if "d2t" in weights and weights["d2t"].shape != (cfg.draft_vocab_size,):
        raise UserError(f"{path}: d2t has shape {tuple(weights['d2t'].shape)}, not ({cfg.draft_vocab_size},)")
    if "t2d" not in weights and "d2t" in weights:
        weights["t2d"] = torch.zeros(cfg.target_vocab_size, dtype=torch.bool)
        ids = torch.arange(cfg.draft_vocab_size) + weights["d2t"].to(torch.int64)
        if ids.numel() and (ids.min() < 0 or ids.max() >= cfg.target_vocab_size):
            raise UserError(f"{path}: d2t maps draft ids outside the target vocabulary of {cfg.target_vocab_size}")
        weights["t2d"][ids] = True
    for name in ("d2t", "t2d"):
        if name in weights:
            weights[name] = weights[name].to(torch.int64 if name == "d2t" else torch.bool)
    try:
        missing, unexpected = draft.load_state_dict(weights, strict=False)
    except RuntimeError as exc:  # a shape that disagrees with the config
        detail = " ".join(str(exc).split("\n\t")[1:2]) or str(exc)
        raise UserError(f"{path}: weights do not fit its config.json ({detail.strip()})") from None
    has_embedding = "embed_tokens.weight" not in missing
    missing = [k for k in missing if k != "embed_tokens.weight"]
    if missing or unexpected:
        raise UserError(f"{path}: weights do not fit an EAGLE-3 draft (missing {missing}, unexpected {unexpected})")
    return has_embedding
