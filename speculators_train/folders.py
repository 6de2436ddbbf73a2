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
# LongRoPE's per-frequency factors (`long_factor`, `short_factor`) are lists of such factors.
_POSITIVE = re.compile(
    r"(^|_)(theta|eps|epsilon)$|^(factor|attention_factor|low_freq_factor|high_freq_factor|long_factor|short_factor)$"
)
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
        if isinstance(value, list) and _POSITIVE.search(key):
            bad = next((v for v in value if not _positive_number(v)), None) if value else "an empty list"
            if bad is not None or not value:
                return f"{name} holds {_shown(bad)}; every factor must be a finite number above 0"
            continue
        if isinstance(value, float) and not math.isfinite(value):
            return f"{name} is {value}, not a finite number"
        if isinstance(value, int | float) and _POSITIVE.search(key) and value <= 0:
            return f"{name} is {value}; it must be above 0 (a model with it computes NaN or collapses positions)"
        if key in _SIZES and (not isinstance(value, int) or not 1 <= value <= _SIZES[key]):
            return f"{name} is {_shown(value)}; it must be an integer in 1..{_SIZES[key]:,}"
    return None


def _positive_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


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
    files = _safetensors_files(path, key)
    if files:
        _check_size(path, key, config, files)
        return
    pickled = pickled_files(path)
    if pickled:
        raise UserError(
            f"{key}: {path} holds only pickled weights ({', '.join(pickled[:3])}), which this toolkit never loads "
            "(unpickling runs code, in transformers and vLLM alike); convert them to safetensors where you trust "
            "them, e.g. AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)"
        )
    raise UserError(f"{key}: {path} has no model.safetensors (nor model.safetensors.index.json)")


def _safetensors_files(path: Path, key: str) -> list[Path]:
    """The weight files a folder's loader reads: those its `model.safetensors.index.json` names (each a safetensors
    file in the folder: an index naming a pickle or a path outside would have it unpickled or read from
    elsewhere), else `model.safetensors`; [] when it has neither."""
    index = path / "model.safetensors.index.json"
    if not index.is_file():
        return [path / "model.safetensors"] if (path / "model.safetensors").is_file() else []
    weight_map = read_json_object(index, f"{key} weight index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise UserError(f"{key}: {index}: weight_map must map tensor names to file names")
    for tensor, file in weight_map.items():
        if not (isinstance(file, str) and file.endswith(".safetensors") and Path(file).name == file):
            raise UserError(
                f"{key}: {index}: weight_map[{_shown(tensor)}] is {_shown(file)}; each must be a .safetensors file "
                "in the folder (pickled weights are never loaded)"
            )
    return [path / file for file in sorted(set(weight_map.values()))]


# A config may ask for at most this many times the parameters its weights hold (4-bit packing stores 8 per element;
# a config's count here over-reads MoE and shared layers by less than 2): past it the model transformers would build
# is not the one on disk, and building it can take all the memory there is.
SIZE_SLACK = 16
SIZE_FLOOR = 10**7  # parameters any config may ask for beside its weights (a test model's, a head's)


def config_parameters(config: dict[str, Any]) -> int | None:
    """About how many parameters a decoder with this (text) config has: attention, MLP (each expert), embeddings;
    None where it does not say its sizes."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    sizes = {k: text.get(k) for k in ("hidden_size", "num_hidden_layers", "vocab_size")}
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sizes.values()):
        return None
    hidden, layers, vocab = sizes["hidden_size"], sizes["num_hidden_layers"], sizes["vocab_size"]

    def size(name: str, default: int) -> int:
        value = text.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default

    heads = size("num_attention_heads", 1)
    head_dim = size("head_dim", max(hidden // heads, 1))
    kv = size("num_key_value_heads", heads)
    experts = max(size(k, 1) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    feed_forward = 3 * hidden * (size("moe_intermediate_size", size("intermediate_size", 4 * hidden)) * experts
                        if experts > 1 else size("intermediate_size", 4 * hidden))  # fmt: skip
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv * head_dim
    return layers * (attention + feed_forward) + vocab * hidden


def _check_size(path: Path, key: str, config: dict[str, Any], files: list[Path]) -> None:
    """Refuse a config that asks for far more parameters than its weight files hold (read from their headers),
    before transformers allocates the model it describes."""
    from speculators_train.loading import open_tensors

    asked = config_parameters(config)
    if asked is None or asked <= SIZE_FLOOR:
        return  # small enough to build whatever the weights hold
    held = 0
    for file in files:
        if not file.is_file():
            return  # a missing shard is named where the target's weights are resolved (`origin`)
        with open_tensors(file, f"{key} weights") as fh:
            for name in fh.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                held += math.prod(fh.get_slice(name).get_shape())
    if asked > SIZE_SLACK * held + SIZE_FLOOR:
        raise UserError(
            f"{key}: {path / 'config.json'} describes a model of about {asked:,} parameters; its weights hold "
            f"{held:,}: the config is not the weights' (a model that size would be built in memory before loading)"
        )
