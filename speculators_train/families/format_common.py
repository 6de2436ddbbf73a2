"""What every family's draft readers and export formats share: the `speculators_config` block, reading safetensors
weights, the checks every draft file passes before its module is built, and float weights in the export dtype
with the vocabulary maps kept integer.

A draft directory may come from anyone, damaged or hostile. Its config's values are typed and in range (the caps
below) before anything is built; the module it describes is then built on the meta device (nothing allocated) and
the files' tensors must match it name for name, in shape and in kind (float, integer, bool), with the vocabulary
maps forming one draft vocabulary (`vocab.checked_maps`). Only then is the real module built and loaded, so it
holds nothing the files do not, but for what a family takes from the target (EAGLE-3's embedding, capped there).
Each refusal is one `UserError` naming the file and the key or tensor.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch
from torch import nn

from speculators_train.architectures import draft_layer_values
from speculators_train.engines.base import MAX_DRAFT_TOKENS
from speculators_train.engines.llamacpp.server import serve_command
from speculators_train.errors import UserError
from speculators_train.families.vocab import checked_maps, kind
from speculators_train.loading import load_tensors, pickled_files, reading, shown

SPECULATORS_VERSION = "0.9.0"  # the format version written; vLLM 0.33 reads it
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Caps on a draft config's sizes, checked before anything is built. Released models sit far below them (hidden
# sizes up to 16,384, MLPs up to 53,248 wide, vocabularies up to 262,144, up to 126 layers); past them a config is
# damaged or hostile (a hidden size of 10**9 would try to allocate before any shape could disagree).
MAX_HIDDEN = 65_536
MAX_INTERMEDIATE = 4 * MAX_HIDDEN
MAX_VOCAB = 1 << 22  # 4,194,304 ids
MAX_LAYERS = 4_096  # target decoder layers: bounds the aux layer ids and target_num_layers
# transformers config keys that describe a saved file rather than the model.
FILE_KEYS = ("transformers_version", "dtype", "torch_dtype", "_name_or_path", "architectures")

_REQUIRED = object()  # `default` of a field without one


def decoder_layers_like(config_class: type, target_config: Any, num_layers: int) -> dict[str, Any]:
    """A `config_class` dict (LlamaConfig, Qwen3Config) of `num_layers` untied decoder layers shaped like the
    target's (`draft_layer_values`: width, heads, MLP width, RoPE, whatever the target's own layers are), without the
    keys that describe a saved file: the layers an EAGLE-3 or DFlash draft is built of."""
    layer = config_class(**draft_layer_values(target_config), num_hidden_layers=num_layers, tie_word_embeddings=False)
    return {k: v for k, v in layer.to_dict().items() if k not in FILE_KEYS}


def bool_field(config: dict[str, Any], key: str, default: bool, name: str = "") -> bool:
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{name or key} must be true or false, got {shown(value)}")
    return value


def dict_field(config: dict[str, Any], key: str, default: Any = _REQUIRED, name: str = "") -> Any:
    value = config.get(key)
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"{name or key} is missing")
        return default
    if not isinstance(value, dict):
        raise ValueError(f"{name or key} must be a JSON object, got {shown(value)}")
    return value


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


def stamp_verifier(config: dict[str, Any], fingerprint: dict[str, Any]) -> None:
    """Record the verifier's revision and config hash (`origin.target_fingerprint`) in a config's
    `speculators_config` block, where there is one: engines read the verifier's name alone, `doctor` reads these."""
    block = config.get("speculators_config")
    verifier = block.get("verifier") if isinstance(block, dict) else None
    if isinstance(verifier, dict):
        verifier.update(fingerprint)


def proposal_k(config: dict[str, Any]) -> int | None:
    """The `speculative_tokens` of a config's `speculators_config` block (`proposal_config`), or None where it has
    none a K could be (a whole number from 1 to `MAX_DRAFT_TOKENS`): an edited export's K of 0, -3 or a billion is
    then no K at all, so doctor's fresh write takes the trained one and names the field as changed."""
    block = config.get("speculators_config")
    methods = block.get("proposal_methods") if isinstance(block, dict) else None
    first = methods[0] if isinstance(methods, list) and methods else None
    k = first.get("speculative_tokens") if isinstance(first, dict) else None
    return k if isinstance(k, int) and not isinstance(k, bool) and 1 <= k <= MAX_DRAFT_TOKENS else None


def shell_arg(value: str | Path) -> str:
    """A path or name as one shell word of a printed command: quoted, and a relative path that starts with `-`
    written `./-...`, which no command takes for an option."""
    text = str(value)
    return shlex.quote(f"./{text}" if text.startswith("-") else text)


def vllm_serve(verifier: str, speculative_config: dict[str, Any]) -> str:
    """The `vllm serve` line for a format's `vllm_speculative_config` (the offline `LLM(...)` takes the same dict)."""
    return f"vllm serve {shell_arg(verifier)} --speculative-config {shlex.quote(json.dumps(speculative_config))}"


def sglang_serve(verifier: str, draft: Path, algorithm: str, steps: int, top_k: int, tokens: int) -> str:
    """The `sglang.launch_server` line for the draft folder `draft` under `--speculative-algorithm algorithm`."""
    return (
        f"python -m sglang.launch_server --model-path {shell_arg(verifier)} --speculative-algorithm {algorithm} "
        f"--speculative-draft-model-path {shell_arg(draft)} --speculative-num-steps {steps} "
        f"--speculative-eagle-topk {top_k} --speculative-num-draft-tokens {tokens}"
    )


def read_weights(path: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """Every tensor of the directory's safetensors files, and what to name as their source in messages (the one
    file, or the directory when the weights are sharded)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = pickled_files(path)
        hint = (
            f"; {pickled} are pickled, and this toolkit never unpickles checkpoint files: convert them to "
            "safetensors where you trust them"
            if pickled
            else ""
        )
        raise UserError(f"{path}: no .safetensors weights next to config.json{hint}")
    out: dict[str, torch.Tensor] = {}
    for file in files:
        tensors = load_tensors(file, "draft weights")
        if twice := sorted(set(tensors) & set(out)):
            raise UserError(f"{file}: draft weights: {twice[:3]} also in another .safetensors file of {path}")
        out.update(tensors)
    return out, files[0] if len(files) == 1 else path


def _listed(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def weight_problems(
    expected: dict[str, torch.Tensor],
    weights: dict[str, torch.Tensor],
    optional: Collection[str] = (),
    spell: Callable[[str], str] = str,
) -> list[str]:
    """Every way `weights` differ from a module's `expected` state: names missing (unless `optional`) or
    unexpected, shapes, and kinds (a float parameter stored as int8 would be cast silently by `load_state_dict`).
    `spell` gives a module name as the file spells it."""
    missing = [spell(name) for name in expected if name not in weights and name not in optional]
    unexpected = [spell(name) for name in weights if name not in expected]
    problems = [
        f"{what} {_listed(names)}" for what, names in (("missing", missing), ("unexpected", unexpected)) if names
    ]
    for name, want in expected.items():
        got = weights.get(name)
        if got is None:
            continue
        if got.shape != want.shape:
            problems.append(f"{spell(name)} has shape {list(got.shape)}, expected {list(want.shape)}")
        elif kind(got) != kind(want):
            problems.append(f"{spell(name)} is {str(got.dtype).removeprefix('torch.')}, expected a {kind(want)} tensor")
    return problems


def load_checked(
    build: Callable[[], nn.Module],
    weights: dict[str, torch.Tensor],
    source: Path,
    config_file: Path,
    optional: Collection[str] = (),
    spell: Callable[[str], str] = str,
) -> nn.Module:
    """The module `build` makes from a checked config, holding `weights` once they fit it (see the module
    docstring); `optional` names tensors the files may leave out (what the target provides), `spell` how the
    files name a module tensor. A draft with vocabulary maps (every family's) gets them checked, and t2d derived
    where the files carry only d2t."""
    with reading(config_file, "draft config"), torch.device("meta"):  # a value no check names (a RoPE block)
        expected = build().state_dict()
    weights = dict(weights)
    if "d2t" in expected:
        with reading(source, "draft weights"):  # ValueError: why the maps are not one vocabulary
            weights["d2t"], weights["t2d"] = checked_maps(
                weights.get("d2t"), weights.get("t2d"), expected["d2t"].numel(), expected["t2d"].numel()
            )
    problems = weight_problems(expected, weights, optional, spell)
    if problems:
        raise UserError(f"{source}: weights do not fit {config_file.name}: {'; '.join(problems)}")
    with reading(config_file, "draft config"):  # MemoryError: what the target provides is larger than this machine
        module = build()
    module.load_state_dict(weights, strict=False)
    return module


class GGUFDraft:
    """What a `gguf` format adds to the format it extends (listed first among its bases): llama.cpp's `draft.gguf`
    beside that format's files. The directory's config.json stays that format's, which reads it back; the printed
    command serves the GGUF next to the target's own file. The conversion (`finish`), the GGUF's architecture and
    llama-server's spec type are each family's."""

    name = "gguf"
    draft_file = "draft.gguf"
    llamacpp_spec_type: str | None

    def detect(self, config: dict[str, Any]) -> bool:
        return False

    def commands(self, out: Path, verifier: str, ev: Any, k: int) -> list[str]:
        return [serve_command(verifier, out / self.draft_file, self.llamacpp_spec_type, k)]


def identity_vocab_maps(draft: nn.Module) -> tuple[str, ...]:
    """The vocabulary maps a speculators-format file leaves out: d2t and t2d where the draft's vocabulary is the
    target's whole one in the target's order (the identity), since vLLM's EAGLE-3, P-EAGLE and DFlash models then
    hold no `draft_id_to_target_id` and refuse a file that ships one; none otherwise. Our readers restore them."""
    cfg = draft.config
    return ("d2t", "t2d") if cfg.draft_vocab_size == cfg.target_vocab_size and not draft.d2t.any() else ()


def with_identity_vocab_maps(weights: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """A file's weights with the identity d2t a full-vocabulary draft may leave out (`identity_vocab_maps`)."""
    if "d2t" not in weights and config.draft_vocab_size == config.target_vocab_size:
        return {**weights, "d2t": torch.zeros(config.draft_vocab_size, dtype=torch.int64)}
    return weights


def export_tensors(
    draft: nn.Module, dtype: str, rename=lambda name: name, skip: tuple[str, ...] = ()
) -> dict[str, torch.Tensor]:
    """Float tensors in `dtype`; the vocabulary maps stay int64 (d2t offsets) and bool (t2d), whatever `dtype` is."""
    out = {}
    for name, tensor in draft.state_dict().items():
        if name in skip:
            continue
        if name == "d2t":
            tensor = tensor.to(torch.int64)
        elif name == "t2d":
            tensor = tensor.to(torch.bool)
        else:
            tensor = tensor.to(DTYPES[dtype])
        out[rename(name)] = tensor.detach().cpu().contiguous()
    return out
