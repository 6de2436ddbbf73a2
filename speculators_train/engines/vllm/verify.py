"""`speculators-train verify --engine vllm`: the recipe's suites decoded by vLLM itself.

vLLM serves the target from the HF folder the native loop runs (for a GGUF target, its dequantised copy), in
float32 on CPU. One engine decodes every suite target-only (the baseline and the reference output); then one
engine per setting decodes the same prompts speculatively: the draft, exported with its family's vLLM format in
float32, at each K of `eval.vllm.speculative_tokens`, and vLLM's draftless `ngram` method. Each suite and
temperature is run twice per engine: one request at a time (latency, batch 1) and, with `eval.vllm.batch`, all
prompts in one call (vLLM batches them). Prompt i is sampled with seed `recipe.seed + i` in both engines.

Counts are vLLM's own spec-decode counters (SPEC.md section 6): a draft is a verify step that carried draft
tokens; AL = 1 + accepted / drafts; per-position acceptance = accepted at position i / drafts. Engines start one
after the other, so the baseline is timed before the speculative runs rather than next to each prompt.
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path
from typing import Any

from tqdm import tqdm

from speculators_train.architectures import recurrent_layers
from speculators_train.engines.vllm import offline
from speculators_train.engines.vllm.engine import ENGINE
from speculators_train.errors import UserError
from speculators_train.export.run import export
from speculators_train.families.base import ExportFormat, LoadedDraft
from speculators_train.origin import resolve_origin
from speculators_train.recipe import Recipe
from speculators_train.target import load_target_config
from speculators_train.verify.report import first_divergence, per_request_al, quartiles
from speculators_train.verify.suites import Suite

NGRAM = {"prompt_lookup_max": 4, "prompt_lookup_min": 2}  # vLLM's documented n-gram example settings
# each draftless method's settings beyond K: suffix decoding keeps vLLM's defaults (tree depth 24, capped at K)
BASELINES: dict[str, dict[str, Any]] = {"ngram": NGRAM, "suffix": {}}


def served_format(loaded: LoadedDraft) -> ExportFormat:
    """The draft family's format that vLLM loads (`FamilySettings.vllm_format`)."""
    name = loaded.family.settings.vllm_format
    if name is None:
        raise UserError(f"{loaded.path}: vLLM serves no {loaded.family.title}s; verify it with --engine native")
    return loaded.family.formats[name]


def refuse_unserved(recipe: Recipe, loaded: LoadedDraft, export_format: ExportFormat) -> None:
    """A draft whose export vLLM would read with another class than the target's (an MTP head of the other style)
    is refused here, where `verify`'s check before loading knew only the family."""
    classes = export_format.vllm_mtp_classes(loaded.draft)
    if classes is None:
        return
    answer = ENGINE.serving(recipe.target, load_target_config(recipe.target), loaded.family.settings, classes)
    if answer.problems:
        raise UserError(f"{loaded.path}: vLLM cannot serve this draft on this target: {'; '.join(answer.problems)}")


def target_dir(recipe: Recipe) -> Path:
    """The HF folder vLLM loads the target from: the one the native loop loads (a GGUF target's dequantised copy)."""
    return Path(resolve_origin(recipe.target)[0])


def settings(
    recipe: Recipe, export_format: ExportFormat | None, exported: Path | None, max_k: int | None = None
) -> list[tuple[str, int, dict[str, Any]]]:
    """(method, K, speculative_config) of each speculative engine: the draft at each K (capped at `max_k`, the most
    the draft proposes, as the native loop caps it; repeats dropped), then the n-gram methods at the first K."""
    cfg = recipe.eval.vllm
    ks = cfg.speculative_tokens or [recipe.eval.num_speculative_tokens]
    out: list[tuple[str, int, dict[str, Any]]] = []
    if export_format is not None and exported is not None:
        for k in dict.fromkeys(min(k, max_k or k) for k in ks):
            spec = export_format.vllm_speculative_config(exported, k)
            assert spec is not None  # served_format picked a vLLM format
            out.append(("draft", k, spec))
    out += [
        (name, ks[0], {"method": name, "num_speculative_tokens": ks[0], **BASELINES[name]}) for name in cfg.baselines
    ]
    return out


def _per_prompt_speedups(spec: offline.Decoded, base: offline.Decoded, batch: int) -> list[float]:
    """Quartiles of each prompt's speedup; with `batch` > 1 every prompt ran in one call and has no time of its own,
    so all three are the call's."""
    if batch != 1:
        return [_rate(spec) / _rate(base)] * 3
    return quartiles(
        [
            (len(s.tokens) / s.seconds) / (len(b.tokens) / b.seconds)
            for s, b in zip(spec.completions, base.completions, strict=True)
            if s.tokens and b.tokens
        ]
    )


def _rate(decoded: offline.Decoded) -> float:
    return sum(len(c.tokens) for c in decoded.completions) / decoded.seconds


def record(
    suite: str,
    method: str,
    k: int,
    temperature: float,
    top_p: float,
    batch: int,
    spec: offline.Decoded,
    base: offline.Decoded,
) -> dict[str, Any]:
    """One suite x setting x temperature x batch record, with the native loop's keys where vLLM measures the same
    thing. `batch` 1: one request at a time, each timed alone; otherwise every prompt in one call."""
    counts = spec.counts
    tokens = [len(c.tokens) for c in spec.completions]
    spec_tokens = sum(tokens)
    prompts = len(tokens)
    # Each target pass emits one token plus the drafts it accepts; the prefill emits the first.
    passes = max(spec_tokens - prompts - counts.accepted, 1)
    spec_rate, base_rate = _rate(spec), _rate(base)
    out = {
        "engine": ENGINE.name,
        "target": "hf",
        "batch": batch,
        "suite": suite,
        "shape": f"chain(K={k})" if method == "draft" else f"{method}(K={k})",
        "method": method,
        "num_speculative_tokens": k,
        "temperature": temperature,
        "top_p": top_p,
        "prompts": prompts,
        "acceptance_length": counts.acceptance_length,
        **per_request_al(
            [c.counts.acceptance_length if c.counts and c.counts.drafts else None for c in spec.completions]
        ),
        "per_position_acceptance": counts.per_position_rates(k),
        "draft_acceptance_rate": counts.accepted / counts.draft_tokens if counts.draft_tokens else 0.0,
        "steps": counts.drafts,
        "drafted": counts.draft_tokens,
        "accepted": counts.accepted,
        "tokens_per_target_pass": (spec_tokens - prompts) / passes,
        "tokens": spec_tokens,
        "target_only_tokens_per_s": base_rate,
        "speculative_tokens_per_s": spec_rate,
        "speedup": spec_rate / base_rate,
        "per_prompt_speedup_quartiles": _per_prompt_speedups(spec, base, batch),
        "seconds": {"speculative": spec.seconds, "target_only": base.seconds},
    }
    if temperature == 0:
        divergence = [
            first_divergence(s.tokens, b.tokens) for s, b in zip(spec.completions, base.completions, strict=True)
        ]
        out["greedy_identical_outputs"] = f"{divergence.count(None)}/{prompts}"
        out["first_divergence"] = divergence
    return out


Runs = dict[tuple[str, float, int], offline.Decoded]


def decode_all(engine: offline.Engine, recipe: Recipe, suites: list[Suite], bar: tqdm) -> Runs:
    """Every suite x temperature x batch size, after one untimed warm-up request."""
    ev = recipe.eval
    engine.generate([suites[0].prompts[0].ids], 8, 0.0, 1.0, [recipe.seed])
    out: Runs = {}
    for suite in suites:
        max_new = ev.max_new_tokens or suite.config.max_new_tokens
        prompts = [p.ids for p in suite.prompts]
        seeds = [recipe.seed + i for i in range(len(prompts))]
        for temperature in ev.temperatures:
            out[suite.config.name, temperature, 1] = engine.one_at_a_time(
                prompts, max_new, temperature, ev.top_p, seeds
            )
            bar.update(len(prompts))
            if ev.vllm.batch and len(prompts) > 1:
                out[suite.config.name, temperature, len(prompts)] = engine.generate(
                    prompts, max_new, temperature, ev.top_p, seeds
                )
                bar.update(len(prompts))
    return out


def engine_dtype(target_config: Any) -> str:
    """float32, as the loop runs the target on CPU, except for a target with recurrent (linear-attention) layers:
    vLLM's gated delta-net kernels there run in bfloat16 only, and float32 stops its engine at start."""
    return "bfloat16" if recurrent_layers(target_config) else "float32"


def engine_for(recipe: Recipe, speculative_config: dict[str, Any] | None) -> offline.Engine:
    cfg = recipe.eval.vllm
    return offline.Engine(
        target_dir(recipe),
        speculative_config,
        dtype=engine_dtype(load_target_config(recipe.target)),
        max_model_len=cfg.max_model_len,
        kv_cache_gib=cfg.kv_cache_gib,
        intel_openmp=cfg.intel_openmp,
        seed=recipe.seed,
    )


def run_vllm(recipe: Recipe, suites: list[Suite], loaded: LoadedDraft | None, out_dir: Path) -> list[dict[str, Any]]:
    """Every (setting, suite, temperature, batch) record; without a draft only the draftless methods run."""
    offline.require()
    if "suffix" in recipe.eval.vllm.baselines and importlib.util.find_spec("arctic_inference") is None:
        raise UserError(
            "eval.vllm.baselines: `suffix` is vLLM's suffix decoding, which needs the arctic-inference package "
            "(`pip install arctic-inference`); install it or drop `suffix`"
        )
    export_format, exported = None, None
    if loaded is not None:
        export_format = served_format(loaded)
        refuse_unserved(recipe, loaded, export_format)
        exported = export(recipe, loaded.path, export_format.name, out_dir / "draft-export", "float32", force=True).path
    with tempfile.TemporaryDirectory(prefix="speculators-train-vllm-") as neutral:
        return _run(recipe, suites, loaded, export_format, exported, Path(neutral))


def _run(
    recipe: Recipe,
    suites: list[Suite],
    loaded: LoadedDraft | None,
    export_format: ExportFormat | None,
    exported: Path | None,
    neutral: Path,
) -> list[dict[str, Any]]:
    """vLLM's `SpeculativeConfig` replaces the asked method by one it reads off the draft's path (a folder under a
    run named after an EAGLE recipe is loaded as EAGLE whatever `method` says, and a draft model then fails to
    load), so vLLM is given a link to the export from `neutral`, a path that names no method."""
    served = None
    if exported is not None:
        served = neutral / "draft"
        served.symlink_to(exported.resolve(), target_is_directory=True)
    cap = loaded.family.draft_tokens(loaded.draft, 1 << 20) if loaded is not None else None
    runs = settings(recipe, export_format, served, cap)
    per_engine = sum(len(s.prompts) for s in suites) * len(recipe.eval.temperatures) * (1 + recipe.eval.vllm.batch)
    max_new = {s.config.name: recipe.eval.max_new_tokens or s.config.max_new_tokens for s in suites}
    records = []
    with tqdm(total=per_engine * (1 + len(runs)), unit="prompt", desc="verify vllm") as bar:
        bar.set_postfix(run="target-only")
        with engine_for(recipe, None) as engine:
            baseline = decode_all(engine, recipe, suites, bar)
        for method, k, spec_config in runs:
            bar.set_postfix(run=f"{method}{k}")
            with engine_for(recipe, spec_config) as engine:
                spec = decode_all(engine, recipe, suites, bar)
                start_seconds = engine.start_seconds
            for (suite, temperature, batch), decoded in spec.items():
                base = baseline[suite, temperature, batch]
                r = record(suite, method, k, temperature, recipe.eval.top_p, batch, decoded, base)
                r["max_new_tokens"] = max_new[suite]
                r["draft"] = str(exported) if method == "draft" else None
                r["checkpoint"] = str(loaded.path) if loaded is not None and method == "draft" else None
                r["speculative_config"] = {**spec_config, "model": str(exported)} if method == "draft" else spec_config
                r["engine_start_seconds"] = start_seconds
                r["vllm_version"] = offline.version()
                r["device"] = "cpu" if not _cuda() else "cuda"
                records.append(r)
    return records


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
