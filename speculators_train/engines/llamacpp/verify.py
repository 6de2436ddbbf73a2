"""`speculators-train verify --engine llama.cpp`: the recipe's suites decoded by llama.cpp itself.

For each target file (the recipe's own GGUF as served, and an unquantized F32 GGUF of the same weights) and each
suite, one llama-server decodes every prompt target-only (the baseline, and the reference output), and one server
per setting decodes it speculatively right after (paired in time, as the native loop pairs them): the draft,
exported to GGUF, at each K, and llama.cpp's draftless n-gram methods. Greedy only: llama.cpp's drafts are argmax.

Counts are llama.cpp's own (SPEC.md section 6 definitions): a verify step is a target pass that carried a draft;
AL = 1 + accepted / steps; per-position acceptance from llama-server's per-position counter. A method that does
not draft at every step (the n-gram ones) is also given `tokens_per_target_pass`: generated tokens per target
decode pass, drafted or not, which is what the speedup follows.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from tqdm import tqdm

from speculators_train.engines.llamacpp.build import ensure_built, version
from speculators_train.engines.llamacpp.converter import convert
from speculators_train.engines.llamacpp.engine import ENGINE
from speculators_train.engines.llamacpp.server import Completion, Server, draft_args
from speculators_train.errors import UserError
from speculators_train.export.run import export
from speculators_train.families.base import ExportFormat, LoadedDraft
from speculators_train.origin import cache_root, gguf_file, resolve_origin
from speculators_train.recipe import Recipe
from speculators_train.verify.report import first_divergence, per_request_al, quartiles
from speculators_train.verify.suites import Suite


def target_files(recipe: Recipe) -> dict[str, Path]:
    """The GGUF files llama.cpp serves the target from, by `eval.llama_cpp.targets` name."""
    out: dict[str, Path] = {}
    source, _ = resolve_origin(recipe.target)
    for name in recipe.eval.llama_cpp.targets:
        if name == "gguf":
            file = gguf_file(recipe.target)
            if file is None:
                continue  # an HF target has no GGUF of its own; f32 stands for it
            out[name] = file
        else:
            out[name] = f32_gguf(Path(source))
    if not out:
        raise UserError("eval.llama_cpp.targets: nothing to serve (an HF target has no 'gguf' file; add 'f32')")
    return out


def f32_gguf(hf_dir: Path) -> Path:
    """An unquantized GGUF of the target as transformers holds it (for a GGUF target: its dequantised weights),
    made once by llama.cpp's converter. Its kernels round the same at every batch width except at near-ties, so
    speculative outputs equal target-only ones (the quantized kernels fork often)."""
    out = cache_root() / "llama.cpp-targets" / f"{hf_dir.name}-{folder_stamp(hf_dir)}-f32.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        convert(hf_dir, out, "f32")
    return out


def folder_stamp(hf_dir: Path) -> str:
    """Which model folder this is, cheaply: its resolved path and each file's name, size and modification time. Two
    folders of one name (`model/` under two projects) or a folder rewritten in place get conversions of their own."""
    digest = hashlib.sha256(str(hf_dir.resolve()).encode())
    for file in sorted(p for p in hf_dir.iterdir() if p.is_file()):
        stat = file.stat()
        digest.update(f"\0{file.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:12]


def record(
    suite: str,
    target_name: str,
    target_file: Path,
    method: str,
    k: int | None,
    spec: list[Completion],
    base: list[Completion],
) -> dict[str, Any]:
    """One suite x target x method record, with the native loop's keys where llama.cpp measures the same thing."""
    steps = sum(c.steps for c in spec)
    accepted = sum(c.accepted for c in spec)
    drafted = sum(c.drafted for c in spec)
    width = max([len(c.accepted_per_position) for c in spec] + [k or 0])
    per_pos = [sum(c.accepted_per_position[i] for c in spec if i < len(c.accepted_per_position)) for i in range(width)]
    spec_tokens = sum(len(c.tokens) for c in spec)
    base_tokens = sum(len(c.tokens) for c in base)
    spec_s = sum(c.seconds + c.prompt_seconds for c in spec)
    base_s = sum(c.seconds + c.prompt_seconds for c in base)
    passes = sum(max(len(c.tokens) - 1 - c.accepted, 1) for c in spec)
    divergence = [first_divergence(s.tokens, b.tokens) for s, b in zip(spec, base, strict=True)]
    spec_rate, base_rate = spec_tokens / spec_s, base_tokens / base_s
    return {
        "engine": ENGINE.name,
        "target_file": target_file.name,
        "target": target_name,
        "suite": suite,
        "shape": method if k is None else f"chain(K={k})",
        "num_speculative_tokens": k,
        "temperature": 0.0,
        "top_p": 1.0,
        "prompts": len(spec),
        "acceptance_length": 1 + accepted / steps if steps else 1.0,
        **per_request_al([1 + c.accepted / c.steps if c.steps else None for c in spec]),
        "per_position_acceptance": [n / steps if steps else 0.0 for n in per_pos],
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "steps": steps,
        "drafted": drafted,
        "accepted": accepted,
        "tokens_per_target_pass": sum(len(c.tokens) - 1 for c in spec) / passes,
        "tokens": spec_tokens,
        "target_only_tokens_per_s": base_rate,
        "speculative_tokens_per_s": spec_rate,
        "speedup": spec_rate / base_rate,
        "per_prompt_speedup_quartiles": quartiles(
            [
                (len(s.tokens) / (s.seconds + s.prompt_seconds)) / (len(b.tokens) / (b.seconds + b.prompt_seconds))
                for s, b in zip(spec, base, strict=True)
                if s.tokens and b.tokens
            ]
        ),
        "seconds": {
            "speculative": spec_s,
            "target_only": base_s,
            "spec_prefill": sum(c.prompt_seconds for c in spec),
            "target_only_decode": sum(c.seconds for c in base),
        },
        "greedy_identical_outputs": f"{divergence.count(None)}/{len(spec)}",
        "first_divergence": divergence,
    }


def served_format(loaded: LoadedDraft) -> ExportFormat:
    """The draft family's format that llama.cpp serves beside the target's GGUF file."""
    for export_format in loaded.family.formats.values():
        if export_format.draft_file:
            return export_format
    raise UserError(
        f"{loaded.path}: llama.cpp has no runtime for {loaded.family.title}s; verify it with --engine native"
    )


def settings(
    recipe: Recipe, export_format: ExportFormat | None, export_dir: Path | None
) -> list[tuple[str, int | None, list[str]]]:
    """(method, K, llama-server arguments beyond the target) for each speculative run: the draft exported at
    `export_dir` in `export_format` (none: only the draftless methods), then llama.cpp's n-gram methods."""
    cfg = recipe.eval.llama_cpp
    out: list[tuple[str, int | None, list[str]]] = []
    if export_format is not None and export_dir is not None:
        draft = export_dir / export_format.draft_file
        out += [
            ("draft", k, draft_args(draft, export_format.llamacpp_spec_type, k, recipe.eval.draft_p_min))
            for k in cfg.speculative_tokens
        ]
    out += [(name, None, ["--spec-type", name]) for name in cfg.baselines]
    return out


def run_llamacpp(
    recipe: Recipe, suites: list[Suite], loaded: LoadedDraft | None, out_dir: Path
) -> list[dict[str, Any]]:
    """Every (target file, suite, setting) record; without a draft only the draftless methods run. The draft is
    exported in float32, the precision it is measured at natively."""
    cfg = recipe.eval.llama_cpp
    ensure_built()
    export_format, exported = None, None
    if loaded is not None:
        export_format = served_format(loaded)
        exported = export(recipe, loaded.path, export_format.name, out_dir / "draft-export", "float32", force=True).path
    runs = settings(recipe, export_format, exported)
    files = target_files(recipe)
    total = sum(len(s.prompts) for s in suites) * len(runs) * 2 * len(files)
    records = []
    logs = out_dir / "llama.cpp-logs"
    with tqdm(total=total, unit="prompt", desc="verify llama.cpp") as bar:
        for target_name, file in files.items():
            base_server = Server(file, [], logs / f"{target_name}-target-only.log", cfg.threads)
            with base_server as base:
                for method, k, args in runs:
                    log = logs / f"{target_name}-{method}{k or ''}.log"
                    with Server(file, args, log, cfg.threads) as spec_server:
                        for suite in suites:
                            max_new = recipe.eval.max_new_tokens or suite.config.max_new_tokens
                            bar.set_postfix(target=target_name, run=f"{method}{k or ''}", suite=suite.config.name)
                            first = suite.prompts[0].ids
                            base.complete(first, 8)  # warm-up, untimed
                            spec_server.complete(first, 8)
                            spec, baseline = [], []
                            for i, prompt in enumerate(suite.prompts):
                                baseline.append(base.complete(prompt.ids, max_new, recipe.seed + i))
                                spec.append(spec_server.complete(prompt.ids, max_new, recipe.seed + i))
                                bar.update(2)
                            r = record(suite.config.name, target_name, file, method, k, spec, baseline)
                            r["max_new_tokens"] = max_new
                            r["draft"] = str(exported) if method == "draft" else None
                            r["checkpoint"] = str(loaded.path) if loaded is not None and method == "draft" else None
                            r["device"] = f"cpu, {base_server.threads} threads"
                            r["llama_cpp_version"] = version()
                            records.append(r)
    return records
