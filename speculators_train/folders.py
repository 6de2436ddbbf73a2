"""Model folders a user names from elsewhere (a target, `draft.start`, `data.regenerate.model`, the folders engines
load), checked before transformers or vLLM reads them.

Three rules, the same for every folder: no custom code (transformers is always called with `trust_remote_code=False`,
so it never asks on a terminal whether to run a folder's code, and a folder whose `auto_map` names classes
transformers does not ship is refused in one line; one that only repeats shipped classes, as Phi-3's hub folders
do, loads those);
safetensors only (a folder with pickled weights alone is refused: unpickling runs code, in transformers and in
vLLM alike); and a config whose numbers a model can run with (`config_problem`: a zero RoPE theta or a negative
epsilon gives NaN logits everywhere, silently).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from speculators_train.errors import UserError
from speculators_train.loading import pickled_files, read_json_object

# Values that divide or scale: a RoPE theta, a norm epsilon, a RoPE scaling factor. Zero, negative or non-finite,
# every logit is NaN or the positions collapse.
_POSITIVE = re.compile(r"(^|_)(theta|eps|epsilon)$|^(factor|attention_factor|low_freq_factor|high_freq_factor)$")
# Sizes: a positive integer up to a bound no released model comes near (a bigger one is a typo or an attack on memory).
_SIZES = {
    "hidden_size": 1 << 16,
    "intermediate_size": 1 << 18,
    "moe_intermediate_size": 1 << 18,
    "num_hidden_layers": 4096,
    "num_attention_heads": 4096,
    "num_key_value_heads": 4096,
    "head_dim": 1 << 14,
    "vocab_size": 1 << 22,
    "max_position_embeddings": 1 << 27,
}


def config_problem(config: Any, prefix: str = "") -> str | None:
    """The first value of a model config (its nested sections too: `text_config`, `rope_parameters` per layer type)
    that no model can run with, named by its path, or None."""
    if not isinstance(config, dict):
        return None
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            problem = config_problem(value, f"{name}.")
            if problem:
                return problem
            continue
        if isinstance(value, bool) or value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            return f"{name} is {value}, not a finite number"
        if isinstance(value, int | float) and _POSITIVE.search(key) and value <= 0:
            return f"{name} is {value}; it must be above 0 (a model with it computes NaN or collapses positions)"
        if key in _SIZES and (not isinstance(value, int) or not 1 <= value <= _SIZES[key]):
            return f"{name} is {_shown(value)}; it must be an integer in 1..{_SIZES[key]:,}"
    return None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _refuse_custom_code(path: Path, key: str, config: dict[str, Any]) -> None:
    """Refuse a folder that loads only through its own code: an `auto_map` whose config model type or tokenizer
    class transformers does not ship."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    needs = []
    if "auto_map" in config and config.get("model_type") not in CONFIG_MAPPING:
        needs.append(f"config.json (model_type {_shown(config.get('model_type'))})")
    tokenizer_file = path / "tokenizer_config.json"
    tokenizer = read_json_object(tokenizer_file, "tokenizer config") if tokenizer_file.is_file() else {}
    name = tokenizer.get("tokenizer_class")
    if "auto_map" in tokenizer and not (isinstance(name, str) and tokenizer_class_from_name(name) is not None):
        needs.append(f"tokenizer_config.json (tokenizer_class {_shown(name)})")
    if needs:
        raise UserError(
            f"{key}: {path} loads only through its own code ({' and '.join(needs)} name classes transformers does "
            "not ship, in auto_map), which this toolkit never runs"
        )


def check_model_folder(source: str | Path, key: str, allow_code: bool = False, what: str | None = None) -> None:
    """A local model folder `key` names, before transformers or vLLM reads it: its config (`check_config`), no
    custom code (`auto_map`) unless `allow_code` (the target's `trust_remote_code`), and safetensors weights. A hub
    id is left to `from_pretrained` with `trust_remote_code=False` and `use_safetensors=True`. `what`: the folder
    in messages about its files (default: `key`)."""
    path = Path(source).expanduser()
    if not path.is_dir():
        if path.exists() or str(source).startswith((".", "/", "~")):
            raise UserError(f"{key}: {source} is not a model folder")
        return
    if not (path / "config.json").is_file():
        raise UserError(f"{key}: {path} has no config.json (not a transformers model folder)")
    config = read_json_object(path / "config.json", f"{what or key} config")
    problem = config_problem(config)
    if problem:
        raise UserError(f"{key}: {path / 'config.json'}: {problem}")
    if not allow_code:
        _refuse_custom_code(path, key, config)
    if (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file():
        return
    pickled = pickled_files(path)
    if pickled:
        raise UserError(
            f"{key}: {path} holds only pickled weights ({', '.join(pickled[:3])}), which this toolkit never loads "
            "(unpickling runs code, in transformers and vLLM alike); convert them to safetensors where you trust "
            "them, e.g. AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)"
        )
    raise UserError(f"{key}: {path} has no model.safetensors (nor model.safetensors.index.json)")
