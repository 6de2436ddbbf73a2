"""The SGLang / original EAGLE layout for EAGLE-3 (SPEC section 5), written and read.

    config.json         a flat LlamaConfig: architectures ["LlamaForCausalLMEagle3"], draft_vocab_size,
                        target_hidden_size, tie_word_embeddings false,
                        eagle_config {eagle_aux_hidden_state_layer_ids, use_aux_hidden_state}
    model.safetensors   fc, midlayer.* (where we write layers.0.*), norm, lm_head, embed_tokens, d2t, t2d

What SGLang's `LlamaForCausalLMEagle3` does with it, and why the writer refuses some drafts:
- it loads a name it does not know by skipping it, so a wrong name runs a random layer instead of failing;
- its decoder layer keeps the un-normalised hidden state as the residual: `norm_before_residual: false` only;
- its `fc` takes exactly 3 target states;
- it captures `id + 1` for each id in `eagle_config`: SGLang counts "the output of layer id", we (and vLLM) count
  "the residual stream entering layer id". Our id k is written as k - 1, so id 0 (the embeddings) cannot be.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import LlamaConfig

from speculators_train.errors import UserError
from speculators_train.export.speculators import clean_layer_config, layer_config, load_weights_into, read_weights
from speculators_train.files import read_json
from speculators_train.models.eagle3 import Eagle3Config, Eagle3Draft

ARCHITECTURE = "LlamaForCausalLMEagle3"


def unsupported(config: Eagle3Config) -> list[str]:
    """Why SGLang could not run this draft as trained (empty when it can)."""
    out = []
    if config.norm_before_residual:
        out.append(
            "norm_before_residual is true, but SGLang's LlamaForCausalLMEagle3 only implements false (it would run "
            "this draft with another residual and draft wrong tokens); export --format speculators for vLLM, or "
            "train with eagle3.norm_before_residual: false"
        )
    if len(config.aux_layer_ids) != 3:
        out.append(f"SGLang's fc takes exactly 3 target states; this draft reads {len(config.aux_layer_ids)}")
    if min(config.aux_layer_ids) < 1:
        out.append(f"aux layer ids {config.aux_layer_ids} include the embeddings (0), which SGLang cannot capture")
    return out


def sglang_config(config: Eagle3Config, dtype: str) -> dict[str, Any]:
    layer = layer_config(config)
    rope = layer.get("rope_parameters") or {}
    out = {
        **layer,
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "tie_word_embeddings": False,  # true would make SGLang use the embedding as the draft-vocab lm_head
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in config.aux_layer_ids],
            "use_aux_hidden_state": True,
        },
        "torch_dtype": dtype,
    }
    if "rope_theta" in rope:  # SGLang builds RoPE from the flat legacy keys
        out["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default":
        out["rope_scaling"] = dict(rope)
    return out


def weight_name(name: str) -> str:
    """Our (speculators-layout) weight name -> SGLang's."""
    return "midlayer." + name[len("layers.0.") :] if name.startswith("layers.0.") else name


def is_sglang_eagle3(path: Path) -> bool:
    config = path / "config.json"
    return config.is_file() and ARCHITECTURE in (read_json(config, "draft config").get("architectures") or [])


def load_sglang_eagle3(path: Path, target_num_layers: int) -> tuple[Eagle3Draft, bool]:
    """A draft from an SGLang/EAGLE-format directory (ours or SpecForge's), and whether it carried `embed_tokens`."""
    config = read_json(path / "config.json", "draft config")
    missing = [
        key for key in ("hidden_size", "vocab_size", "num_attention_heads", "draft_vocab_size") if key not in config
    ]
    if missing:
        raise UserError(f"{path / 'config.json'}: not an EAGLE-3 {ARCHITECTURE} config (missing {missing})")
    known = set(LlamaConfig().to_dict())
    layer = {k: v for k, v in LlamaConfig(**config).to_dict().items() if k in known}
    eagle = config.get("eagle_config") or {}
    if eagle.get("eagle_aux_hidden_state_layer_ids"):
        aux = [int(i) + 1 for i in eagle["eagle_aux_hidden_state_layer_ids"]]
    else:
        n = target_num_layers
        aux = [2, n // 2, n - 3]  # SGLang's default, already in our convention
    draft = Eagle3Draft(
        Eagle3Config(
            layer_config=clean_layer_config(layer),
            target_hidden_size=config.get("target_hidden_size") or config["hidden_size"],
            draft_vocab_size=int(config["draft_vocab_size"]),
            aux_layer_ids=aux,
            norm_before_residual=False,  # the only convention SGLang runs
        )
    )
    weights = {}
    for name, tensor in read_weights(path).items():
        name = name.removeprefix("model.")
        weights["layers.0." + name[len("midlayer.") :] if name.startswith("midlayer.") else name] = tensor
    return draft, load_weights_into(draft, weights, path)
