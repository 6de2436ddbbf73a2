"""Load the target model (named default, hub id, local HF directory or GGUF file) and capture its states.

Layer-id convention: id k is the residual stream after k decoder layers, i.e. HF's ``output_hidden_states[k]``
(0 = embeddings). The "final" state is the last decoder layer's output *before* the final norm, so that
``lm_head(norm(final))`` reproduces the target's logits.

Which states a forward records is a value (`StateSpec`) handed to each call: a draft that reads other layers than
the recipe's never changes the target everybody shares.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from speculators_train import architectures
from speculators_train.architectures import is_composite, model_class, nextn_layer_prefixes, text_config, text_decoder
from speculators_train.errors import UserError
from speculators_train.head import TargetHead, logit_transform, meta_model
from speculators_train.loading import describe, reading
from speculators_train.origin import TargetConfig, resolve_origin
from speculators_train.packed import packed_linears

log = logging.getLogger(__name__)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"target.device: {name!r} requested but CUDA is not available on this machine")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


@dataclass(frozen=True)
class StateSpec:
    """Target states a forward records: the residual stream at `aux_layer_ids` (concatenated in that order) and,
    with `final`, the last decoder layer's pre-norm output."""

    aux_layer_ids: tuple[int, ...] = ()
    final: bool = False


NO_STATES = StateSpec()  # a forward that records nothing (target-only decoding, an oracle)


def _stable_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class Target:
    """A loaded target: model, tokenizer and the recipe's aux layer ids (what `generate` stores; never reassigned:
    a draft that reads other layers passes its own `StateSpec`)."""

    model: nn.Module
    tokenizer: object
    name_or_path: str
    hub_id: str | None
    aux_layer_ids: list[int]
    device: torch.device
    cpu_packed_weights: bool = False
    processor: object = None  # a multimodal target's processor (images -> tokens and pixel values); None otherwise
    no_images: str = ""  # why a multimodal target has no processor (`load_processor`); "" when it has one or is text
    _decoder: nn.Module = field(init=False, repr=False)

    def __post_init__(self) -> None:
        try:
            self._decoder = text_decoder(self.model)
        except UserError as exc:
            raise UserError(f"target {self.name_or_path}: {exc}") from None
        # Id N (after the last layer) is excluded: engines capture aux states below N only.
        bad = [i for i in self.aux_layer_ids if i >= self.num_layers]
        if bad:
            raise UserError(
                f"target.aux_layer_ids: {bad} out of range for a target with {self.num_layers} layers "
                f"(ids run 0..{self.num_layers - 1})"
            )

    @property
    def config(self):
        """The model's config: a multimodal target's composite one (its text decoder's: `text_config`)."""
        return self.model.config

    @property
    def text_config(self):
        return text_config(self.model.config)

    @property
    def num_layers(self) -> int:
        return len(self._decoder.layers)

    @property
    def hidden_size(self) -> int:
        return self.text_config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().weight.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def reads_images(self) -> bool:
        """A multimodal target (with or without a loadable processor): its records' images are part of the input."""
        return self.processor is not None or bool(self.no_images)

    @property
    def chat_template(self) -> str:
        template = getattr(self.tokenizer, "chat_template", None) or getattr(self.processor, "chat_template", None)
        if not template:
            raise UserError(f"target {self.name_or_path}: tokenizer has no chat template")
        return template

    @property
    def embed_tokens(self) -> nn.Module:
        return architectures.decoder_embedding(self._decoder)

    @property
    def final_norm(self) -> nn.Module:
        return architectures.final_norm(self._decoder)

    @property
    def lm_head(self) -> nn.Module:
        return self.model.get_output_embeddings()

    def identity(self) -> dict:
        """What must match for two sets of hidden states to be mixed (the image processor's settings named only where
        there is one, so a text target's sets still resume)."""
        image_processor = getattr(self.processor, "image_processor", None)
        return {
            "name_or_path": self.name_or_path,
            "architecture": type(self.model).__name__,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "tokenizer_hash": self.tokenizer_hash(),
            "chat_template_hash": _stable_hash(self.chat_template),
            **({"image_processor_hash": _stable_hash(image_processor.to_json_string())} if image_processor else {}),
        }

    def tokenizer_hash(self) -> str:
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            data = json.loads(backend.to_str())
            text = json.dumps({"model": data.get("model"), "added": data.get("added_tokens")}, sort_keys=True)
        else:
            text = json.dumps(sorted(self.tokenizer.get_vocab().items()))
        return _stable_hash(text)

    @property
    def aux_and_final(self) -> StateSpec:
        """What the generator stores for training: the recipe's aux layers and the final pre-norm state."""
        return StateSpec(tuple(self.aux_layer_ids), final=True)

    @contextlib.contextmanager
    def capture(self, spec: StateSpec) -> Iterator[dict[int | str, torch.Tensor]]:
        """Record the residual stream at `spec.aux_layer_ids` and (with `spec.final`) the pre-norm final state
        during a forward, keyed by layer id and "final"."""
        store: dict[int | str, torch.Tensor] = {}
        hooks = []

        def keep(key: int | str):
            def hook(_module, _args, output):
                state = output[0] if isinstance(output, tuple) else output
                if state.dim() != 3:  # several residual streams (DeepSeek-V4's hyper-connections): a draft reads one
                    shape = f"{tuple(state.shape)}, not [batch, tokens, hidden]; no draft here reads them"
                    raise UserError(f"target {self.name_or_path!r}: its decoder layers output states of shape {shape}")
                store[key] = state

            return hook

        wanted: dict[nn.Module, list[int | str]] = {}
        for layer_id in spec.aux_layer_ids:
            module = self.embed_tokens if layer_id == 0 else self._decoder.layers[layer_id - 1]
            wanted.setdefault(module, []).append(layer_id)
        if spec.final:
            wanted.setdefault(self._decoder.layers[-1], []).append("final")
        for module, keys in wanted.items():
            for key in keys:
                hooks.append(module.register_forward_hook(keep(key)))
        try:
            yield store
        finally:
            for handle in hooks:
                handle.remove()

    @staticmethod
    def gathered(store: dict[int | str, torch.Tensor], spec: StateSpec) -> torch.Tensor:
        """The captured states of `spec` as one tensor [..., (len(ids) + final) * H]: aux in id order, then final."""
        parts = [store[i] for i in spec.aux_layer_ids] + ([store["final"]] if spec.final else [])
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    @torch.inference_mode()
    def hidden_states(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        spec: StateSpec | None = None,
        vision: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Aux states concatenated in id order [B, T, len(ids)*H] (None when `spec` reads none) and the pre-norm
        final state [B, T, H]; `spec` defaults to `aux_and_final`. `vision`: the processor's tensors for the images
        in `input_ids` (`data/render.py`).

        Runs the decoder body only where there are no images: the lm_head (a vocab-sized matmul) is not needed to
        store states. With images the whole multimodal model runs (its vision tower puts the image features at the
        image tokens and, for M-RoPE, sets positions from the image grids), its head on the last position alone.
        Inputs go to the target's device; the states stay there.
        """
        spec = StateSpec((spec or self.aux_and_final).aux_layer_ids, final=True)
        with self.capture(spec) as store:
            mask = attention_mask.to(self.device) if attention_mask is not None else None  # None: no padding
            if vision:
                tensors = {
                    k: v.to(self.device, self.dtype) if v.is_floating_point() else v.to(self.device)
                    for k, v in vision.items()
                }
                self.model(
                    input_ids=input_ids.to(self.device),
                    attention_mask=mask,
                    use_cache=False,
                    logits_to_keep=1,
                    **tensors,
                )
            else:
                self._decoder(input_ids=input_ids.to(self.device), attention_mask=mask, use_cache=False)
        aux = self.gathered(store, StateSpec(spec.aux_layer_ids)) if spec.aux_layer_ids else None
        return aux, store["final"]

    def packed(self, rows: int, *others: nn.Module) -> contextlib.AbstractContextManager[bool]:
        """The target's linears (and those of `others`, e.g. a draft) on oneDNN-packed weights within the block,
        when `target.cpu_packed_weights` is on and the model is float32 on CPU (see `speculators_train.packed`).
        `rows`: the row count to tune for. No-grad forwards only, and no weight may change inside the block."""
        return packed_linears([self.model, *others] if self.cpu_packed_weights else [], rows)

    def head(self) -> TargetHead:
        """The target's final norm + lm_head as a frozen head: its own norm module and lm_head weight (shared, not
        copied for the norm)."""
        return TargetHead(self.final_norm, self.lm_head.weight.detach(), logit_transform(self.config))

    def logits_from_final(self, final: torch.Tensor) -> torch.Tensor:
        """Target logits from a stored pre-norm final state: lm_head(norm(h_N)), scaled and soft-capped as the
        target's class does."""
        return logit_transform(self.config)(self.lm_head(self.final_norm(final)))


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """The engines' default [2, N//2, N-3]; below 7 layers it repeats or reverses ids (engines capture each
    layer once, in order), so such a target needs ids chosen in the recipe."""
    ids = [2, num_layers // 2, num_layers - 3]
    if ids[0] < ids[1] < ids[2]:
        return ids
    hint = (
        f"set target.aux_layer_ids, e.g. [1, {num_layers // 2}, {num_layers - 1}]"
        if num_layers >= 4
        else f"it has {max(num_layers - 1, 0)} capturable ids (1..N-1), fewer than the 3 an EAGLE-3 draft reads"
    )
    raise UserError(
        f"target.aux_layer_ids: the default [2, N//2, N-3] is {ids} for a target with {num_layers} layers, not 3 "
        f"distinct ascending ids; {hint}"
    )


def load_target_config(cfg: TargetConfig):
    """The target's transformers config alone (no weights): what the engine checks need."""
    from transformers import AutoConfig

    source, _ = resolve_origin(cfg)
    if Path(source).is_dir():
        with reading(Path(source) / "config.json", "target config"):  # one line, as load_head_weights says it
            return AutoConfig.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    try:
        return AutoConfig.from_pretrained(source, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    except Exception as exc:
        raise UserError(f"could not read the config of target {cfg.name_or_path!r}: {describe(exc)}") from None


def load_processor(cfg: TargetConfig, config=None) -> tuple[object, str]:
    """A multimodal target's processor (its image processor and the tokenizer) and "", or None and why it has none:
    "" for a text-only target (its records' images are dropped, their text kept); the reason for a multimodal one
    whose processor cannot be loaded (its records with images are then skipped with that reason: their text alone
    is not what the served model reads)."""
    from transformers import AutoProcessor

    config = config if config is not None else load_target_config(cfg)
    if not is_composite(config):
        return None, ""
    source, _ = resolve_origin(cfg)
    try:
        processor = AutoProcessor.from_pretrained(
            source, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code
        )
    except Exception as exc:  # e.g. a video processor that needs torchvision, a checkpoint without processor files
        return None, f"its processor could not be loaded: {describe(exc)[:200]}"
    if getattr(processor, "image_processor", None) is None:
        return None, "it ships no image processor"
    return processor, ""


def load_tokenizer(cfg: TargetConfig):
    """The target's tokenizer (with its chat template) alone: what rendering the data needs."""
    from transformers import AutoTokenizer

    source, _ = resolve_origin(cfg)
    try:
        return AutoTokenizer.from_pretrained(source, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    except Exception as exc:
        raise UserError(f"could not load the tokenizer of target {cfg.name_or_path!r}: {describe(exc)}") from None


def load_target(cfg: TargetConfig, weights: bool = True) -> Target:
    """Load tokenizer and model on the configured device/dtype; eval mode, no gradients. The model is loaded as the
    class its config names (a multimodal checkpoint as its multimodal class, whose text decoder is the target).

    `weights=False` builds the model's structure on the meta device from its config, reading no weights: its
    identity, tokenizer and layer count for a stage where another engine (vLLM) runs the target."""
    from transformers import AutoConfig, AutoTokenizer

    source, hub_id = resolve_origin(cfg)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    kwargs = {"revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code}
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        config = AutoConfig.from_pretrained(source, **kwargs)
        processor, no_images = load_processor(cfg, config)
        if not weights:
            model = meta_model(config, cfg.trust_remote_code)
            meta = torch.device("meta")
            return _target(cfg, model.eval().requires_grad_(False), tokenizer, hub_id, meta, processor, no_images)
        # safetensors only, hub ids too: a pickled checkpoint is never unpickled here.
        model, info = model_class(config, cfg.trust_remote_code).from_pretrained(
            source, config=config, dtype=dtype, use_safetensors=True, output_loading_info=True, **kwargs
        )
    except UserError:
        raise
    except Exception as exc:  # a damaged file fails anywhere inside transformers: one line naming the target
        raise UserError(f"could not load target {cfg.name_or_path!r}: {describe(exc)}") from None
    if missing := sorted(info["missing_keys"]):  # transformers would run them at random initial values
        raise UserError(
            f"could not load target {cfg.name_or_path!r}: its weights lack {len(missing)} tensors of the model "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
        )
    nextn = nextn_layer_prefixes(config)
    # e.g. a config.json that names fewer layers than the weights; a target's own MTP layers are not the model's
    if unexpected := sorted(k for k in info["unexpected_keys"] if not k.startswith(nextn)):
        raise UserError(
            f"could not load target {cfg.name_or_path!r}: its weights hold {len(unexpected)} tensors its config.json "
            f"does not describe ({', '.join(unexpected[:3])}{', ...' if len(unexpected) > 3 else ''}); the config "
            "and the weights are of different models"
        )
    model.to(device).eval().requires_grad_(False)
    return _target(cfg, model, tokenizer, hub_id, device, processor, no_images)


def _target(
    cfg: TargetConfig,
    model: nn.Module,
    tokenizer,
    hub_id: str | None,
    device: torch.device,
    processor=None,
    no_images: str = "",
) -> Target:
    num_layers = len(text_decoder(model).layers)
    ids = cfg.aux_layer_ids or default_aux_layer_ids(num_layers)
    return Target(
        model=model,
        tokenizer=tokenizer,
        name_or_path=cfg.name_or_path,
        hub_id=hub_id,
        aux_layer_ids=list(ids),
        device=device,
        cpu_packed_weights=cfg.cpu_packed_weights,
        processor=processor,
        no_images=no_images,
    )
