"""`speculators-train verify`: score a draft with the real target on the recipe's eval suites.

For each suite and temperature, prompt by prompt: target-only decoding (the baseline, same KV cache and prefill),
then speculative decoding of the same prompt with the same seed (see `run_paired`). Results land in
<run dir>/verify/<timestamp>/ with the exact recipe used.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn
from tqdm import tqdm
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from speculators_train.errors import UserError
from speculators_train.export.drafts import check_fits, fill_embedding, load_any_draft
from speculators_train.files import atomic_write_bytes, read_json
from speculators_train.models.eagle3 import Eagle3Draft
from speculators_train.models.medusa import MedusaDraft
from speculators_train.recipe import Recipe
from speculators_train.runinfo import write_run_info
from speculators_train.target import Target, load_target
from speculators_train.verify.decoder import Generation, SpeculativeDecoder, decode_plain, verify_width
from speculators_train.verify.proposers import Eagle3Proposer, MedusaProposer, Proposer, TreeSpec, measured_tree
from speculators_train.verify.report import score, write_outputs
from speculators_train.verify.sampling import Sampling
from speculators_train.verify.suites import Suite, load_suite


def load_draft_for(target: Target, path: Path) -> tuple[Eagle3Draft | MedusaDraft, Path]:
    """A draft of ours or one in the speculators/SGLang/vLLM-Medusa layout made elsewhere, on the target's device
    and dtype, its embedding taken from the target unless it ships one, shapes checked; and the directory read."""
    draft, has_embedding, resolved = load_any_draft(path, target.num_layers)
    cfg = draft.config
    check_fits(resolved, cfg, target.hidden_size, target.vocab_size, target.num_layers)
    device = next(target.model.parameters()).device
    if isinstance(draft, MedusaDraft):
        return draft.to(device=device, dtype=target.dtype).eval(), resolved
    target.aux_layer_ids = list(cfg.aux_layer_ids)  # capture what this draft was trained on
    fill_embedding(draft, has_embedding, target.embed_tokens.weight)
    draft = draft.to(device=device, dtype=target.dtype).eval()
    # `.to(dtype)` also rounds RoPE's inv_freq buffer; rebuild it in fp32 as training and engines keep it.
    draft.rotary_emb = LlamaRotaryEmbedding(cfg.llama).to(device)
    return draft, resolved


def proposer_for(draft: Eagle3Draft | MedusaDraft, target: Target) -> Proposer:
    if isinstance(draft, MedusaDraft):
        return MedusaProposer(draft, target.final_norm)
    return Eagle3Proposer(draft)


def rank_accuracies(checkpoint: Path, heads: int) -> list[list[float]]:
    """Per-head rank accuracies [head][rank] recorded with a Medusa checkpoint's held-out metrics."""
    state_file = checkpoint / "trainer_state.json"
    held_out = read_json(state_file, "trainer state").get("held_out", {}) if state_file.is_file() else {}
    out = []
    for h in range(heads):
        row = []
        while f"rank{len(row)}_acc_{h}" in held_out:
            row.append(float(held_out[f"rank{len(row)}_acc_{h}"]))
        out.append(row)
    if not all(out):
        raise UserError(
            f"{checkpoint}: eval.tree.shape 'measured' needs the held-out per-head rank accuracies that a Medusa "
            "checkpoint trained by this toolkit records; this one has none (use shape 'dynamic')"
        )
    return out


def eos_ids(target: Target) -> set[int]:
    ids = {target.tokenizer.eos_token_id}
    configured = getattr(target.model.generation_config, "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return {i for i in ids if i is not None}


def _seeded(target: Target, seed: int) -> torch.Generator:
    return torch.Generator(device=target.model.device).manual_seed(seed)


def run_speculative(
    decoder: SpeculativeDecoder, target: Target, suite: Suite, max_new: int, seed: int, bar: tqdm
) -> list[Generation]:
    """Prompt i gets generator seed `seed + i`, as in `run_paired`."""
    eos = eos_ids(target)
    out = []
    for i, prompt in enumerate(suite.prompts):
        out.append(decoder.generate(prompt.ids, max_new, eos, _seeded(target, seed + i)))
        bar.update(1)
    return out


def reuse(decoder: SpeculativeDecoder) -> Callable[[list[int], Generation], SpeculativeDecoder]:
    """The same decoder for every prompt of `run_paired` (which lets a setting pick one per prompt)."""
    return lambda ids, base: decoder


def run_paired(
    target: Target,
    suite: Suite,
    max_new: int,
    sampling: Sampling,
    seed: int,
    bar: tqdm,
    decoders: list[Callable[[list[int], Generation], SpeculativeDecoder]],
) -> tuple[list[Generation], list[list[Generation]]]:
    """Target-only decoding (the baseline: same KV cache and prefill) and each speculative decoder, prompt by
    prompt: prompt i is decoded target-only and then by every decoder back to back, all with generator seed
    `seed + i`. Paired in time, a slow spell on a shared machine slows a prompt's baseline and its speculative
    runs alike; a baseline timed once before every setting turned one such spell into a 1.63x "speedup" that
    the paired rerun measured at 1.05x. Each decoder is picked from the prompt ids and that prompt's baseline
    (an oracle replays it). Returns the baseline and one list of generations per decoder."""
    eos = eos_ids(target)
    baseline: list[Generation] = []
    runs: list[list[Generation]] = [[] for _ in decoders]
    for i, prompt in enumerate(suite.prompts):
        base = decode_plain(target, prompt.ids, max_new, eos, sampling, _seeded(target, seed + i))
        baseline.append(base)
        bar.update(1)
        for pick, out in zip(decoders, runs, strict=True):
            out.append(pick(prompt.ids, base).generate(prompt.ids, max_new, eos, _seeded(target, seed + i)))
            bar.update(1)
    return baseline, runs


def warm_up(target: Target, decoder: SpeculativeDecoder, suite: Suite) -> None:
    """One short untimed run of each path with the decoder's sampling, so first-call costs (allocations, kernel
    selection, the top-p sort and multinomial at T > 0) stay out of both sides' figures."""
    prompt = suite.prompts[0].ids
    decode_plain(target, prompt, 8, set(), decoder.sampling, torch.Generator(device=target.model.device))
    decoder.generate(prompt, 8, set(), torch.Generator(device=target.model.device))


def verify_packing(
    target: Target, draft: nn.Module, shapes: list[tuple[int, TreeSpec | None]]
) -> contextlib.AbstractContextManager:
    """The target's and the draft's linears on oneDNN-packed weights (`Target.packed`), tuned for the widest
    verify pass of these (K, tree) shapes, for the baseline and the speculative runs alike. The draft must not be
    trained inside the block."""
    return target.packed(max(verify_width(k, tree) for k, tree in shapes), draft)


def shape_of(recipe: Recipe, draft: Eagle3Draft | MedusaDraft, checkpoint: Path) -> tuple[str, int, TreeSpec | None]:
    """(label, K as scored, tree spec or None) for the recipe's eval mode and this draft. Medusa drafts at most
    one token per head."""
    ev = recipe.eval
    heads = draft.config.num_heads if isinstance(draft, MedusaDraft) else None
    if ev.mode == "tree":
        t = ev.tree
        if t.shape == "measured":
            if heads is None:
                raise UserError("eval.tree.shape 'measured' builds a Medusa tree; EAGLE-3 drafts grow theirs")
            depth = min(t.depth, heads)
            paths = measured_tree(rank_accuracies(checkpoint, depth), t.budget)
            tree = TreeSpec(t.top_k, depth, t.budget, paths)
            return tree.describe(), max(map(len, paths)), tree
        tree = TreeSpec(t.top_k, t.depth if heads is None else min(t.depth, heads), t.budget)
        return tree.describe(), tree.depth, tree
    k = ev.num_speculative_tokens if heads is None else min(ev.num_speculative_tokens, heads)
    return f"chain(K={k})", k, None


def verify(recipe: Recipe, draft_path: Path, out_dir: Path | None = None) -> tuple[Path, list[dict[str, Any]]]:
    target = load_target(recipe.target)
    draft, checkpoint = load_draft_for(target, draft_path)
    ev = recipe.eval
    suites = [
        load_suite(recipe.resolve_path(s, "eval.suites"), recipe, target.tokenizer, ev.num_prompts) for s in ev.suites
    ]
    out_dir = out_dir or recipe.run_dir / "verify" / time.strftime("%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    dump = recipe.model_dump(mode="json")
    atomic_write_bytes(out_dir / "recipe.yaml", yaml.safe_dump(dump, sort_keys=False).encode())
    write_run_info(out_dir, dump)
    shape, k, tree = shape_of(recipe, draft, checkpoint)
    total = 2 * sum(len(s.prompts) for s in suites) * len(ev.temperatures)
    records = []
    packing = verify_packing(target, draft, [(k, tree)])
    with packing, tqdm(total=total, unit="prompt", desc="verify") as bar:
        for suite in suites:
            max_new = ev.max_new_tokens or suite.config.max_new_tokens
            for temperature in ev.temperatures:
                sampling = Sampling(temperature, ev.top_p)
                decoder = SpeculativeDecoder(target, proposer_for(draft, target), sampling, k, tree)
                warm_up(target, decoder, suite)
                bar.set_postfix(suite=suite.config.name, T=temperature, run=shape)
                baseline, (speculative,) = run_paired(
                    target, suite, max_new, sampling, recipe.seed, bar, [reuse(decoder)]
                )
                record = score(suite.config.name, shape, k, temperature, ev.top_p, speculative, baseline)
                record["draft"] = str(draft_path)
                record["checkpoint"] = str(checkpoint)
                record["max_new_tokens"] = max_new
                record["device"] = str(target.model.device)
                records.append(record)
    write_outputs(out_dir, records)
    return out_dir, records
