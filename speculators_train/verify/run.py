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
from tqdm import tqdm

from speculators_train import engines
from speculators_train.engines.serving import serving
from speculators_train.errors import UserError
from speculators_train.eval_config import EvalConfig
from speculators_train.families.base import LoadedDraft
from speculators_train.families.drafts import check_fits, load_draft
from speculators_train.files import atomic_write_bytes
from speculators_train.layout import RUN_INFO, held_out_metrics, verify_dir
from speculators_train.proposal import Sampling, TreeSpec
from speculators_train.recipe import Recipe
from speculators_train.runinfo import write_run_info
from speculators_train.target import Target, load_target, load_target_config
from speculators_train.verify.decoder import (
    Generation,
    SpeculativeDecoder,
    decode_plain,
    refuse_unlooped,
    verify_width,
)
from speculators_train.verify.ngram import NgramProposer
from speculators_train.verify.report import score, write_outputs
from speculators_train.verify.suites import Suite, load_suite


def load_draft_for(target: Target, path: Path) -> LoadedDraft:
    """A draft of ours or one in a family's export format made elsewhere, shapes checked against the target, given
    what it takes from the target (its embedding, unless it ships one), on the target's device and dtype. The
    target is not changed: the draft's proposer names the states it reads."""
    loaded = load_draft(path, target.num_layers)
    check_fits(loaded, target.hidden_size, target.vocab_size, target.num_layers)
    loaded.family.attach_target(loaded.draft, target.embed_tokens.weight, loaded.has_embedding)
    loaded.draft = loaded.family.place(loaded.draft, next(target.model.parameters()).device, target.dtype)
    return loaded


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
    runs alike, where a baseline timed once before every setting would read such a spell as a speedup. Each
    decoder is picked from the prompt ids and that prompt's baseline
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
    target: Target, draft: torch.nn.Module, shapes: list[tuple[int, TreeSpec | None]]
) -> contextlib.AbstractContextManager:
    """The target's and the draft's linears on oneDNN-packed weights (`Target.packed`), tuned for the widest
    verify pass of these (K, tree) shapes, for the baseline and the speculative runs alike. The draft must not be
    trained inside the block."""
    return target.packed(max(verify_width(k, tree) for k, tree in shapes), draft)


def shape_of(ev: EvalConfig, loaded: LoadedDraft) -> tuple[str, int, TreeSpec | None]:
    """(label, K as scored, tree spec or None) for the recipe's eval mode and this draft (a draft proposes at most
    its family's `draft_tokens` per step)."""
    family, draft = loaded.family, loaded.draft
    if ev.mode == "tree":
        vocab = getattr(getattr(draft, "config", None), "draft_vocab_size", None)
        if vocab is not None and ev.tree.top_k > vocab:
            raise UserError(f"eval.tree.top_k {ev.tree.top_k}: the draft at {loaded.path} proposes from {vocab} tokens")
        held_out = held_out_metrics(loaded.path)
        try:
            tree = family.tree(draft, ev.tree, held_out)
        except UserError as exc:  # a tree this draft cannot grow: named with the draft read
            raise UserError(f"{loaded.path}: {exc}") from None
        depth = max(map(len, tree.paths)) if tree.paths is not None else tree.depth
        return tree.describe(), depth, tree
    k = family.draft_tokens(draft, ev.num_speculative_tokens)
    return f"chain(K={k})", k, None


def check_engine(recipe: Recipe) -> None:
    """Refuse, before anything is loaded, a run that `eval.engine` cannot make on this target: a layer type the
    loop cannot verify, its trees on a recurrent target, an engine that cannot serve this family's draft on it (or
    not on this machine)."""
    config = load_target_config(recipe.target)
    settings = recipe.draft
    engine = recipe.eval.engine
    if engine == "native":
        refuse_unlooped(config, repr(recipe.target.name_or_path), recipe.eval.mode == "tree")
        return
    answer = serving(engine, recipe.target, config, settings)
    if reasons := answer.problems + answer.here:
        raise UserError(
            f"eval.engine {engine!r} cannot run a {settings.family} draft on this target: {'; '.join(reasons)}"
        )


def sampling_at(ev: EvalConfig, temperature: float) -> Sampling:
    """How the loop samples and drafts at `temperature`, as the recipe's eval section says."""
    return Sampling(temperature, ev.top_p, ev.draft_sampling, ev.draft_p_min)


def verify(recipe: Recipe, draft_path: Path, out_dir: Path | None = None) -> tuple[Path, list[dict[str, Any]]]:
    """Score the draft at `draft_path` on the recipe's suites in `eval.engine`; returns the results directory
    and its records."""
    check_engine(recipe)
    target = load_target(recipe.target)
    loaded = load_draft_for(target, draft_path)
    ev = recipe.eval
    suites = [load_suite(recipe.resolve_path(s, "eval.suites"), recipe, target, ev.num_prompts) for s in ev.suites]
    out_dir = out_dir or verify_dir(recipe.run_dir) / time.strftime("%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    dump = recipe.model_dump(mode="json")
    atomic_write_bytes(out_dir / "recipe.yaml", yaml.safe_dump(dump, sort_keys=False).encode())
    write_run_info(out_dir / RUN_INFO, dump)
    if ev.engine == "native":
        records = run_native(recipe, target, loaded, suites, draft_path)
    else:
        run = engines.get(ev.engine).runner()
        del target  # the engine runs the target from here on; free the transformers copy
        records = run(recipe, suites, loaded, out_dir)
    write_outputs(out_dir, records)
    return out_dir, records


def run_native(
    recipe: Recipe, target: Target, loaded: LoadedDraft, suites: list[Suite], draft_path: Path
) -> list[dict[str, Any]]:
    """Our loop: per suite and temperature, each prompt target-only, with the draft, and (at T = 0) with each
    draftless baseline of `eval.baselines`, back to back."""
    ev = recipe.eval
    shape, k, tree = shape_of(ev, loaded)
    free = [f"{name}(K={k})" for name in ev.baselines]
    total = sum(len(s.prompts) for s in suites) * (2 * len(ev.temperatures) + len(free) * (0 in ev.temperatures))
    records = []
    with verify_packing(target, loaded.draft, [(k, tree)]), tqdm(total=total, unit="prompt", desc="verify") as bar:
        for suite in suites:
            max_new = ev.max_new_tokens or suite.config.max_new_tokens
            for temperature in ev.temperatures:
                sampling = sampling_at(ev, temperature)
                decoder = SpeculativeDecoder(target, loaded.family.proposer(loaded.draft, target), sampling, k, tree)
                warm_up(target, decoder, suite)
                bar.set_postfix(suite=suite.config.name, T=temperature, run=shape)
                labels = [shape, *(free if temperature == 0 else [])]
                decoders = [reuse(decoder)]
                decoders += [reuse(SpeculativeDecoder(target, NgramProposer(), sampling, k)) for _ in labels[1:]]
                baseline, runs = run_paired(target, suite, max_new, sampling, recipe.seed, bar, decoders)
                for label, speculative in zip(labels, runs, strict=True):
                    record = score(suite.config.name, label, k, temperature, ev.top_p, speculative, baseline)
                    record.update(draft=str(draft_path), checkpoint=str(loaded.path), max_new_tokens=max_new,
                                  draft_sampling=ev.draft_sampling, device=str(target.model.device))  # fmt: skip
                    records.append(record)
    return records
