"""The speculators / vLLM EAGLE-3 layout (SPEC section 5), read into this toolkit's draft class.

    config.json         speculators_model_type "eagle3", transformer_layer_config (a LlamaConfig dict),
                        draft_vocab_size, norm_before_residual, target_hidden_size,
                        eagle_aux_hidden_state_layer_ids, speculators_config {...}
    model.safetensors   fc, layers.0.*, norm, lm_head, [embed_tokens], d2t (int64), t2d (bool); no `model.` prefix

Aux layer ids there count like ours and vLLM's (id k = the residual stream entering layer k). A missing
`norm_before_residual` means true, as vLLM reads it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from speculators_train.errors import UserError
from speculators_train.files import read_json
from speculators_train.models.eagle3 import Eagle3Config, Eagle3Draft


def is_speculators_eagle3(path: Path) -> bool:
    config = path / "config.json"
    return config.is_file() and read_json(config, "draft config").get("speculators_model_type") == "eagle3"


def _weights(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(f"{path}: no .safetensors weights next to config.json")
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
    layer.update(num_hidden_layers=1, tie_word_embeddings=False)
    for key in (
        "transformers_version",
        "dtype",
        "torch_dtype",
        "_name_or_path",
        "architectures",
        "model_type",
        "layer_types",
        "mlp_layer_types",
    ):
        layer.pop(key, None)
    n = target_num_layers
    aux = config.get("eagle_aux_hidden_state_layer_ids") or [2, n // 2, n - 3]
    draft = Eagle3Draft(
        Eagle3Config(
            layer_config=layer,
            target_hidden_size=config.get("target_hidden_size") or layer["hidden_size"],
            draft_vocab_size=int(config["draft_vocab_size"]),
            aux_layer_ids=list(aux),
            norm_before_residual=bool(config.get("norm_before_residual", True)),
        )
    )
    weights = _weights(path)
    if "d2t" not in weights and draft.config.draft_vocab_size == draft.config.target_vocab_size:
        weights["d2t"] = torch.zeros(draft.config.draft_vocab_size, dtype=torch.int64)
        weights["t2d"] = torch.ones(draft.config.target_vocab_size, dtype=torch.bool)
    for name in ("d2t", "t2d"):
        if name in weights:
            weights[name] = weights[name].to(torch.int64 if name == "d2t" else torch.bool)
    missing_keys, unexpected = draft.load_state_dict(weights, strict=False)
    has_embedding = "embed_tokens.weight" not in missing_keys
    missing_keys = [k for k in missing_keys if k != "embed_tokens.weight"]
    if missing_keys or unexpected:
        raise UserError(
            f"{path}: weights do not fit an EAGLE-3 draft (missing {missing_keys}, unexpected {unexpected})"
        )
    return draft, has_embedding
