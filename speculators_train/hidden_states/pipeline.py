"""One chunk of conversations through the target: regenerated replies (optional), rendered samples, and the
hidden states the family reads, captured by transformers or by vLLM. `generate` stores the result as shards; online
training and online distillation use it in memory."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from speculators_train.architectures import pads_exactly
from speculators_train.data.chat import Chat
from speculators_train.data.conversations import Conversation, SkipReport, has_images
from speculators_train.data.regenerate import (
    check_replying_tokenizer,
    regenerate,
    regenerate_llamacpp,
    regenerate_vllm,
    replying_model,
)
from speculators_train.data.render import Sample, render_many
from speculators_train.errors import UserError
from speculators_train.families.base import FamilySettings
from speculators_train.origin import gguf_file, resolve_origin
from speculators_train.recipe import Recipe
from speculators_train.target import DTYPES, StateSpec, Target

if TYPE_CHECKING:
    from speculators_train.hidden_states.vllm_capture import VllmCapture


def recipe_states(draft: FamilySettings, target: Target) -> StateSpec:
    """The states captured for the recipe's family (its section's `target_states`): `generate` stores these."""
    level = draft.target_states
    return StateSpec(tuple(target.aux_layer_ids) if level == "aux+final" else (), final=level != "none")


def _batches(samples: list[Sample], max_tokens: int, pad: bool = True) -> Iterator[list[int]]:
    """Indices grouped longest-first so each padded batch stays under `max_tokens` with little padding; without
    `pad`, only samples of one length share a batch."""
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i].input_ids))
    batch: list[int] = []
    for i in order:
        longest = len(samples[batch[0]].input_ids) if batch else len(samples[i].input_ids)
        if batch and (longest * (len(batch) + 1) > max_tokens or (not pad and len(samples[i].input_ids) < longest)):
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


def padded_batches(
    samples: list[Sample], max_tokens: int, device: torch.device, pad: bool = True
) -> Iterator[tuple[list[int], list[int], torch.Tensor, torch.Tensor | None]]:
    """(sample indices, lengths, right-padded ids, attention mask or None when nothing is padded) per batch; without
    `pad`, batches of one length (no mask)."""
    for batch in _batches(samples, max_tokens, pad):
        lengths = [len(samples[i].input_ids) for i in batch]
        ids = torch.zeros(len(batch), max(lengths), dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for row, (i, n) in enumerate(zip(batch, lengths, strict=True)):
            ids[row, :n] = samples[i].input_ids
            mask[row, :n] = 1
        yield batch, lengths, ids.to(device), mask.to(device) if min(lengths) < max(lengths) else None


def capture(
    target: Target, samples: list[Sample], max_tokens: int, dtype: torch.dtype, spec: StateSpec | None = None
) -> list[dict[str, Any]]:
    """Hidden states for each sample (original order), unpadded, on CPU in the storage dtype: the aux states of
    `spec` (default: the target's aux layers) unless it reads none, and the final state unless `spec` says not.
    Samples with images run one at a time, with their pixel values, through the multimodal model."""
    keep_final = spec is None or spec.final
    out: list[dict[str, Any] | None] = [None] * len(samples)
    text = [i for i, s in enumerate(samples) if s.vision is None]
    batches = (
        ([text[j] for j in batch], lengths, ids, attention, None)
        for batch, lengths, ids, attention in padded_batches(
            [samples[i] for i in text], max_tokens, target.device, pads_exactly(target.config)
        )
    )
    images = (([i], [len(s.input_ids)], s.input_ids[None], None, s.vision) for i, s in enumerate(samples) if s.vision)
    for batch, lengths, ids, attention, vision in itertools.chain(batches, images):
        aux, final = target.hidden_states(ids, attention, spec, vision)
        final = final.to(dtype).cpu()
        aux = aux.to(dtype).cpu() if aux is not None else None
        for row, (i, n) in enumerate(zip(batch, lengths, strict=True)):
            sample = samples[i]
            out[i] = {"id": sample.id, "record": sample.record}
            out[i].update(input_ids=sample.input_ids, loss_mask=sample.loss_mask)
            if aux is not None:
                out[i]["aux_hidden_states"] = aux[row, :n].clone()
            if keep_final:
                out[i]["hidden_state"] = final[row, :n].clone()
    return out


def _without_images(chunk: list[Conversation], reason: str, skips: SkipReport) -> list[Conversation]:
    """The chunk's records without images, the others counted under `reason`: a path that would run the target on
    their text alone (regeneration, vLLM capture), which is not what the served model reads."""
    kept = []
    for conv in chunk:
        if any(map(has_images, conv.messages)):
            skips.skip(reason, conv.origin)
        else:
            kept.append(conv)
    return kept


@dataclass
class ChunkResult:
    samples: list[dict[str, Any]]
    skips: SkipReport


def process_chunk(
    recipe: Recipe,
    target: Target,
    chunk: list[Conversation],
    seed: int,
    spec: StateSpec | None = None,
    engine: VllmCapture | None = None,
    replying: Any = None,
) -> ChunkResult:
    """Conversations -> (optionally regenerated) -> rendered -> hidden states (`spec`, default: what the recipe's
    family trains on), captured by `engine` when given, else by the transformers target; regenerated through vLLM
    by `replying` (`replying_engine`) when given, else by an engine opened for the chunk. Shared by offline shards,
    online training and online distillation."""
    skips = SkipReport()
    spec = spec or recipe_states(recipe.draft, target)
    data, max_tokens = recipe.data, recipe.generation.max_tokens_per_batch
    chat = Chat.of(target, data.chat_template_kwargs, data.images)
    if target.reads_images and engine is not None:
        chunk = _without_images(chunk, "images_not_captured_by_vllm", skips)
    if target.reads_images and data.regenerate.enabled:
        chunk = _without_images(chunk, "images_not_regenerated", skips)
    # One packed copy of the target's weights per chunk (CPU float32, `target.cpu_packed_weights`), for
    # regeneration and capture alike; offline shards and online training both come through here.
    with target.packed(max_tokens) if engine is None else contextlib.nullcontext():
        regen = data.regenerate
        if regen.enabled and regen.engine == "llama.cpp":
            gguf = gguf_file(recipe.target)
            chunk = regenerate_llamacpp(chunk, chat, regen, data.max_length, seed, gguf)
        elif regen.enabled and regen.engine == "vllm":
            if regen.model is not None:
                check_replying_tokenizer(regen.model, target.tokenizer)
            chunk = regenerate_vllm(chunk, chat, regen, data.max_length, seed, replying_model_dir(recipe), replying)
        elif regen.enabled:
            model = replying_model(regen.model, target.model, target.tokenizer) if regen.model else target.model
            chunk = regenerate(chunk, model, chat, regen, data.max_length, seed)
        rendered = render_many(chunk, chat, data.max_length, data.overlong, skips)
        samples = [s for group in rendered for s in group]
        dtype = DTYPES[recipe.generation.storage_dtype]
        if engine is not None:
            captured = engine.capture(samples, dtype, spec)
        else:
            captured = capture(target, samples, max_tokens, dtype, spec)
        return ChunkResult(finite_states(captured, target), skips)


def finite_states(captured: list[dict[str, Any]], target: Target) -> list[dict[str, Any]]:
    """`captured`, refused when a state is NaN or inf: a target whose weights or config are broken (a negative norm
    epsilon, a zero RoPE theta) would otherwise fill a complete, valid-looking set with states no draft learns from."""
    for sample in captured:
        for key in ("aux_hidden_states", "hidden_state"):
            if key in sample and not bool(torch.isfinite(sample[key]).all()):
                raise UserError(
                    f"target {target.name_or_path}: its {key} for record {sample['record']!r} holds NaN or inf; its "
                    "weights or config (norm epsilons, RoPE theta, storage dtype range) are broken, nothing is stored"
                )
    return captured


def replying_model_dir(recipe: Recipe) -> Path:
    """The folder vLLM regenerates replies with: `data.regenerate.model`, else the target's."""
    return Path(recipe.data.regenerate.model or resolve_origin(recipe.target)[0])
