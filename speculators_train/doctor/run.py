"""`speculators-train doctor <recipe>`: the export against the trained checkpoint as the serving engine reads it,
the training data against the target as served, and the K a verify run's measurements recommend."""

from __future__ import annotations

import time
from pathlib import Path

from speculators_train.doctor.acceptance import check_exposure, check_vocabulary
from speculators_train.doctor.data import check_data
from speculators_train.doctor.k import check_k
from speculators_train.doctor.report import Check, write
from speculators_train.doctor.serve import check_export, check_vllm
from speculators_train.errors import UserError
from speculators_train.export.run import latest_verify_report, written_verifier
from speculators_train.families.base import LoadedDraft
from speculators_train.families.drafts import check_fits, load_draft
from speculators_train.head import load_head_weights
from speculators_train.layout import checkpoints_dir, doctor_dir, export_dir, held_out_metrics, verify_dir
from speculators_train.loading import read_json_object
from speculators_train.origin import resolve_origin
from speculators_train.proposal import Sampling
from speculators_train.recipe import Recipe
from speculators_train.target import Target, load_target
from speculators_train.verify.decoder import decode_plain
from speculators_train.verify.run import eos_ids
from speculators_train.verify.suites import load_suite


def greedy_replies(recipe: Recipe, target: Target) -> tuple[list[list[int]], str]:
    """The target's greedy replies to the first eval suite's prompts (eval.num_prompts, eval.max_new_tokens)."""
    ev = recipe.eval
    suite = load_suite(recipe.resolve_path(ev.suites[0], "eval.suites"), recipe, target, ev.num_prompts)
    max_new = ev.max_new_tokens or suite.config.max_new_tokens
    eos = eos_ids(target)
    replies = [decode_plain(target, p.ids, max_new, eos, Sampling(), None).tokens for p in suite.prompts]
    return replies, f"{len(replies)} prompts of {suite.config.name}"


def served_dtype(config: dict, default: str) -> str:
    """The float dtype an export's config names (`dtype`, or the older `torch_dtype`)."""
    return str(config.get("dtype") or config.get("torch_dtype") or default)


def serve_checks(recipe: Recipe, loaded: LoadedDraft, export: Path, on_disk: dict | None, engine: str) -> list[Check]:
    """The export at `export` (its config.json: `on_disk`, None where there is none) against the checkpoint
    `loaded`, and as `engine` reads it. The target's embedding and config are read as `export` reads them, so the
    draft is written from the same tensors."""
    target_config, head = load_head_weights(recipe.target)
    loaded.family.attach_target(loaded.draft, head["embed"], loaded.has_embedding)
    if on_disk is None:
        return [Check("export", "skip", f"no export at {export}", "run `speculators-train export <recipe>`")]
    fmt = next((f for f in loaded.family.formats.values() if f.detect(on_disk)), None)
    if fmt is None:
        raise UserError(f"{export}: not an export of a {loaded.family.name} draft")
    if fmt.draft_file:
        return [Check(f"{fmt.name} export", "skip", "a GGUF export: its metadata is not compared yet")]
    verifier, architectures = written_verifier(recipe, target_config, resolve_origin(recipe.target)[1])
    k = loaded.family.draft_tokens(loaded.draft, recipe.eval.num_speculative_tokens)
    fresh = fmt.write(loaded.draft, served_dtype(on_disk, recipe.export.dtype), verifier, architectures, k)
    checks = check_export(loaded, fmt, export, on_disk, fresh)
    if engine == "vllm":
        try:
            checks.append(check_vllm(on_disk, fresh[0]))
        except ImportError:
            checks.append(Check("vLLM reads the export as trained", "skip", "vLLM is not installed here"))
    return checks


def doctor(
    recipe: Recipe, export: Path | None, checkpoint: Path | None, engine: str, out_dir: Path | None
) -> tuple[Path, list[Check]]:
    """Every check, written to `out_dir` (default <run dir>/doctor/<timestamp>)."""
    export = export or export_dir(recipe.run_dir) / recipe.export.format
    on_disk = read_json_object(export / "config.json", "export config") if (export / "config.json").is_file() else None
    target = load_target(recipe.target)
    loaded = load_draft(checkpoint or checkpoints_dir(recipe.run_dir), target.num_layers)
    check_fits(loaded, target.hidden_size, target.vocab_size, target.num_layers)
    checks = serve_checks(recipe, loaded, export, on_disk, engine)
    identity = target.identity()
    greedy, where = greedy_replies(recipe, target)
    del target
    serve_dtype = served_dtype(on_disk or {}, recipe.export.dtype)
    checks += check_data(recipe.hidden_states_dir, identity, serve_dtype)
    report = latest_verify_report(recipe, loaded.path)
    records = [r for r in (report[1] if report else []) if r.get("engine", "native") == "native"]
    record = records[0] if records else None
    checks.append(check_vocabulary(loaded, greedy, where))
    checks.append(check_exposure(record, held_out_metrics(loaded.path)))
    checks.append(check_k(record, str(verify_dir(recipe.run_dir))))
    out_dir = out_dir or doctor_dir(recipe.run_dir) / time.strftime("%Y%m%d-%H%M%S")
    write(out_dir, checks, f"doctor: {recipe.source_path}, {engine}")
    return out_dir, checks
