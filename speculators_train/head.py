"""The target's head (final norm + lm_head, with its logit soft-capping) as a frozen module, and its weights read
from the target's files without building the model: what a trainer needs of a target whose states are stored."""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from speculators_train.architectures import final_norm, model_class, text_config, text_decoder
from speculators_train.chunks import chunk_rows, chunked
from speculators_train.errors import UserError
from speculators_train.loading import open_tensors, reading
from speculators_train.origin import TargetConfig, _weight_map, resolve_origin


@dataclass(frozen=True)
class LogitTransform:
    """What the target's class does to its lm_head's output: multiply by `factor` (Cohere's `logit_scale`) or
    divide by it (`divide`: Granite's `logits_scaling`), then soft-cap at `cap` (Gemma 2/3: cap * tanh(x / cap)); with
    `cap_first`, the cap comes first."""

    factor: float = 1.0
    divide: bool = False
    cap: float | None = None
    cap_first: bool = False

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` transformed as HF computes them, operation by operation (unchanged for a plain head)."""
        if self.cap is not None and self.cap_first:
            logits = torch.tanh(logits / self.cap) * self.cap
        if self.factor != 1.0:
            logits = logits / self.factor if self.divide else logits * self.factor
        if self.cap is not None and not self.cap_first:
            logits = torch.tanh(logits / self.cap) * self.cap
        return logits


def logit_transform(config) -> LogitTransform:
    """The final-logit transform of the target's class, measured on the class itself (`_probe`): its forward with
    the decoder and lm_head replaced, so whatever it applies after lm_head (a scale, a division, soft-capping, both)
    is what a training head applies. A transform these do not describe is refused, so a draft is never distilled
    against logits that are not the target's."""
    key = config.to_json_string(use_diff=False)
    if key not in _TRANSFORMS:
        _TRANSFORMS[key] = _measured(config)
    return _TRANSFORMS[key]


_TRANSFORMS: dict[str, LogitTransform] = {}


def _probe(config, values: torch.Tensor) -> torch.Tensor:
    """The target class's logits for lm_head outputs `values` [T] (its forward on the meta-built model, with an
    identity lm_head and, in place of the module its forward calls for states, one that returns `values` as the last
    state): the base model where the class has one (a multimodal wrapper's whole inner model), else its text decoder
    (Llama-4 calls a causal LM, whose own forward applies its head)."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    class Output(BaseModelOutputWithPast):
        def __getattr__(self, name: str):  # a wrapper also reads its inner model's extras (rope_deltas, images' states)
            if name.startswith("__"):
                raise AttributeError(name)
            return None

    class Embed(nn.Module):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return torch.zeros(*ids.shape, 1)

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = Embed()  # a wrapper may embed the ids itself (Llama-4)

        def forward(self, *args, **kwargs):
            return Output(last_hidden_state=values.reshape(1, -1, 1))

    model = meta_model(config)
    target = getattr(model, model.base_model_prefix, None) if model.base_model_prefix else None
    if not isinstance(target, nn.Module):
        target = text_decoder(model)
    parent, _, name = next(n for n, m in model.named_modules() if m is target).rpartition(".")
    setattr(model.get_submodule(parent), name, Decoder())
    model.set_output_embeddings(nn.Identity())
    with torch.no_grad():
        out = model(input_ids=torch.zeros(1, values.numel(), dtype=torch.long), use_cache=False)
    return out.logits.reshape(-1).double()


def _measured(config) -> LogitTransform:
    """The transform `_probe` shows: its factor from lm_head outputs small enough that a cap is linear there, taken
    as the config value it equals (multiplied) or inverts (divided by), then checked on large outputs."""
    text = text_config(config)
    cap = getattr(text, "final_logit_softcapping", None) or None
    small = torch.tensor([1e-4, -2e-4, 3e-4], dtype=torch.float32)
    scale = (_probe(config, small) / small.double()).mean().item()
    factor, divide = scale, False
    for name, value in vars(text).items():
        if "logit" in name and isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            if math.isclose(scale, value, rel_tol=1e-3):
                factor, divide = float(value), False
            elif math.isclose(scale, 1 / value, rel_tol=1e-3):
                factor, divide = float(value), True
    if math.isclose(scale, 1.0, rel_tol=1e-3):
        factor, divide = 1.0, False
    # a config's cap the class does not apply (Gemma 3's multimodal wrapper) is no cap
    candidates = [LogitTransform(factor, divide, cap, first) for first in (False, True)] if cap else []
    large = torch.tensor([-90.0, -7.5, 0.5, 12.0, 75.0], dtype=torch.float32)
    seen = _probe(config, large)
    for candidate in [*candidates, LogitTransform(factor, divide)]:
        if torch.allclose(candidate(large.double()), seen, rtol=1e-4, atol=1e-4):
            return candidate
    raise UserError(
        f"target model_type {text.model_type!r} transforms its logits in a way the training head does not "
        f"reproduce (after lm_head: {large.tolist()} -> {[round(v, 4) for v in seen.tolist()]})"
    )


def norm_offset(norm: nn.Module) -> float:
    """1.0 for a norm that scales by (1 + w) (Gemma, Qwen3-Next store the weight as an offset from 1), 0.0 for one
    that scales by w: read off the target's own norm module, which a zero weight leaves the identity or zero."""
    probe = copy.deepcopy(norm).to_empty(device="cpu").float()
    with torch.no_grad():
        for param in probe.parameters():
            param.zero_()
        out = probe(torch.ones(1, probe.weight.shape[-1]))
    return 1.0 if out.abs().sum() > 0 else 0.0


def head_norm_offset(config) -> float:
    """`norm_offset` of the final norm of a target with this config (built on the meta device, no weights)."""
    return norm_offset(final_norm(text_decoder(meta_model(config))))


class TargetHead(nn.Module):
    """The target's final norm + lm_head (+ logit soft-capping where the target has it), frozen: turns stored
    pre-norm states into target logits."""

    def __init__(
        self, norm: nn.Module, lm_head_weight: torch.Tensor, transform: LogitTransform = LogitTransform()
    ) -> None:
        super().__init__()
        self.norm = norm
        # on the weight's device: a head made from a CUDA target must not compute on the CPU
        self.lm_head = nn.Linear(
            lm_head_weight.shape[1], lm_head_weight.shape[0], bias=False, device=lm_head_weight.device
        )
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head_weight)
        self.transform = transform
        self.requires_grad_(False)

    @classmethod
    def from_weights(cls, config, weights: dict[str, torch.Tensor]) -> TargetHead:
        """From `load_head_weights`' config and tensors, without the model: the final norm is a module of the
        target's own class (Llama's RMSNorm, Gemma's 1 + w, whatever the architecture uses)."""
        transform = logit_transform(config)  # first: a head this module does not reproduce is refused before any work
        norm = copy.deepcopy(final_norm(text_decoder(meta_model(config)))).to_empty(device="cpu").float()
        with torch.no_grad():
            for name, param in norm.named_parameters():
                param.copy_(weights[HEAD_NORM_PREFIX + name])
        return cls(norm, weights["lm_head"], transform)

    def forward(self, final: torch.Tensor) -> torch.Tensor:
        return self.transform(self.lm_head(self.norm(final)))

    def on(self, final: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The target's logits over the ids whose lm_head rows are `weight` only (a draft vocabulary), float32."""
        normed = self.norm(final.to(self.lm_head.weight.dtype))
        return self.transform(nn.functional.linear(normed, weight)).float()

    @torch.no_grad()
    def greedy(self, final: torch.Tensor) -> torch.Tensor:
        """The target's top-1 id over its whole vocabulary [..., T] from pre-norm states [..., T, H], computed over
        chunks of positions: the full-vocabulary logits of a long sample never exist at once."""
        flat = final.reshape(-1, final.shape[-2], final.shape[-1]) if final.dim() > 2 else final[None]
        rows = chunk_rows(flat.shape[0], self.lm_head.weight.shape[0])
        (ids,) = chunked(lambda y: (self(y.to(self.lm_head.weight.dtype)).argmax(-1),), rows, flat)
        return ids.reshape(final.shape[:-1])


# `load_head_weights` keys: "embed", "lm_head", "norm" (the final norm's weight) and "norm.<param>" for each of the
# final norm's parameters (its weight again, a bias where it has one).
HEAD_NORM_PREFIX = "norm."


def meta_model(config, trust_remote_code: bool = False) -> nn.Module:
    """The target's model built from its config on the meta device: its modules, names and tied weights, no
    memory."""
    cls = model_class(config, trust_remote_code)
    with torch.device("meta"), _without_zero3_init():
        if hasattr(cls, "from_config"):  # an Auto class
            return cls.from_config(config, trust_remote_code=trust_remote_code)
        return cls._from_config(config)


@contextlib.contextmanager
def _without_zero3_init() -> Iterator[None]:
    """Under a live ZeRO-3 config transformers builds every model inside `deepspeed.zero.Init`, which partitions
    and initialises weights: a meta-device model has none to copy. Hide the config while the meta model is built."""
    try:
        from transformers.integrations import deepspeed as hf_deepspeed
    except ImportError:
        yield
        return
    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def _checkpoint_names(model: nn.Module, keys: list[str]) -> dict[str, str]:
    """The model's own parameter name for each checkpoint tensor name, by the renamings transformers applies when
    it loads this model (a multimodal checkpoint's `language_model.model.*` is `model.language_model.*` in the
    model); names map to themselves where transformers has no renaming."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:  # a transformers without checkpoint conversion: names are the model's
        return {key: key for key in keys}
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if not isinstance(t, WeightRenaming)]
    wanted = dict(model.state_dict(keep_vars=True))
    prefix = getattr(model, "base_model_prefix", None)
    out = {}
    for key in keys:
        name = rename_source_key(key, renamings, converters, prefix, wanted)[0]
        if name not in wanted and key in wanted:  # already the model's name (a checkpoint transformers saved), as
            name = rename_source_key(key, [], [], prefix, wanted)[0]  # its loader reads it: DeepSeek-V4's `.norm.`
        out[key] = name
    return out


def target_folder(cfg: TargetConfig) -> Path:
    """The target's local folder: its own, or the hub snapshot of its configs and safetensors."""
    source, _ = resolve_origin(cfg)
    local = Path(source)
    if not local.is_dir():
        from huggingface_hub import snapshot_download

        local = Path(snapshot_download(source, revision=cfg.revision, allow_patterns=["*.json", "*.safetensors"]))
    return local


def load_head_weights(cfg: TargetConfig, local: Path | None = None):
    """The target's config, embedding, final norm and lm_head, read from its safetensors without building the
    model: a trainer needs these ~2% of an 8B target's weights, not all 16 GB. Tensors are found by the model's own
    module names (through a multimodal wrapper to its text decoder), mapped to the checkpoint's names as
    transformers maps them when it loads the model. `local`: the target's folder, when already found
    (`target_folder`)."""
    from transformers import AutoConfig

    local = local or target_folder(cfg)
    with reading(local / "config.json", "target config"):  # a config transformers cannot read, in one line
        config = AutoConfig.from_pretrained(local, trust_remote_code=cfg.trust_remote_code)
    model = meta_model(config, cfg.trust_remote_code)
    module_names = {id(module): name for name, module in model.named_modules()}
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    norm = final_norm(text_decoder(model))
    wanted = {"embed": f"{module_names[id(embed)]}.weight", "lm_head": f"{module_names[id(lm_head)]}.weight"}
    wanted |= {HEAD_NORM_PREFIX + n: f"{module_names[id(norm)]}.{n}" for n, _ in norm.named_parameters()}
    tied = lm_head.weight is embed.weight
    weight_map = _weight_map(local)
    files = sorted(set(weight_map.values())) if weight_map is not None else ["model.safetensors"]
    found: dict[str, tuple[Path, str]] = {}
    for file_name in files:
        file = local / file_name
        if not file.is_file():
            raise UserError(f"target {cfg.name_or_path}: {file} is missing")
        with open_tensors(file, "target weights") as fh:
            keys = list(fh.keys())
        for key, name in _checkpoint_names(model, keys).items():
            found.setdefault(name, (file, key))
    out = {}
    for role, name in wanted.items():
        if role == "lm_head" and tied:
            continue
        if name not in found:
            raise UserError(
                f"target {cfg.name_or_path}: tensor {name} not found in {local} (the model's {role}, under any name "
                "transformers loads it from)"
            )
        file, key = found[name]
        with open_tensors(file, "target weights") as fh:
            out[role] = fh.get_tensor(key).float()
    if tied:
        out["lm_head"] = out["embed"]
    out["norm"] = out[HEAD_NORM_PREFIX + "weight"]
    return config, out
