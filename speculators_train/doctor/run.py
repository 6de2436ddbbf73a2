"""`speculators-train doctor <recipe>`: the export against the trained checkpoint as the serving engine reads it,
the training data against the target as served, and the K a verify run's measurements recommend."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

from speculators_train import engines
from speculators_train.data.chat import Chat
from speculators_train.data.splits import load_splits
from speculators_train.doctor.acceptance import (
    check_baseline,
    check_engine_baselines,
    check_exposure,
    check_suites,
    check_vocabulary,
    draft_ids,
)
from speculators_train.doctor.classes import acceptance_by_class, check_classes
from speculators_train.doctor.curve import check_curve, curve_points
from speculators_train.doctor.data import check_data, check_verifier, check_vocab_map
from speculators_train.doctor.k import batch_costs, check_engine_k, check_k, check_sweep
from speculators_train.doctor.report import Check, write
from speculators_train.doctor.requests import check_rendering, check_system_prompt, read_requests
from speculators_train.doctor.serve import ServedExport, check_export
from speculators_train.doctor.sweep import sweep_k
from speculators_train.errors import UserError
from speculators_train.export.k import loop_record, measured
from speculators_train.export.records import MAX_BATCH
from speculators_train.export.run import VerifyReport, latest_verify_report, skipped_notes, written_verifier
from speculators_train.families.base import LoadedDraft
from speculators_train.families.drafts import check_fits, load_draft
from speculators_train.families.format_common import proposal_k
from speculators_train.head import load_head_weights
from speculators_train.layout import (
    METRICS,
    checkpoints_dir,
    doctor_dir,
    export_dir,
    held_out_metrics,
    train_dir,
    verify_dir,
)
from speculators_train.loading import read_json_object
from speculators_train.origin import resolve_origin, target_fingerprint
from speculators_train.proposal import Sampling
from speculators_train.recipe import Recipe
from speculators_train.target import Target, load_target
from speculators_train.verify.decoder import SpeculativeDecoder
from speculators_train.verify.run import eos_ids, load_draft_for
from speculators_train.verify.suites import Suite, load_suite


@dataclass(frozen=True)
class DoctorOptions:
    """`batch`: also the best K at this many concurrent requests; `sweep`: measure the loop at K = 1..K;
    `prompts`: a file of real requests, checked against the training data and decoded for the acceptance checks."""

    batch: int = 1
    sweep: bool = False
    prompts: Path | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.batch <= MAX_BATCH:
            raise UserError(f"--batch {self.batch}: expected 1 to {MAX_BATCH} concurrent requests (doctor times the "
                            "target's passes at that batch, holding a cache per request)")  # fmt: skip


def first_suite(recipe: Recipe, target: Target) -> Suite:
    ev = recipe.eval
    return load_suite(recipe.resolve_path(ev.suites[0], "eval.suites"), recipe, target, ev.num_prompts)


def loop_checks(
    target: Target, loaded: LoadedDraft, prompts: list[list[int]], max_new: int, k: int, where: str
) -> list[Check]:
    """The loop's greedy decode of `prompts` with the draft at K = `k`: its tokens are the target's own greedy ones
    (the loop's guarantee), which the vocabulary ceiling reads, and its steps give acceptance by token class."""
    placed = load_draft_for(target, loaded.path)
    decoder = SpeculativeDecoder(target, placed.family.proposer(placed.draft, target), Sampling(), k)
    eos = eos_ids(target)
    generations = [decoder.generate(ids, max_new, eos, None) for ids in prompts]
    inside = draft_ids(loaded)
    counts = acceptance_by_class(
        generations, lambda t: target.tokenizer.decode([t]), lambda t: inside is None or t in inside
    )
    return [check_vocabulary(loaded, [g.tokens for g in generations], where), check_classes(counts, where)]


def request_checks(recipe: Recipe, target: Target, path: Path) -> tuple[list[Check], list[list[int]], str]:
    """(checks, the first eval.num_prompts requests' prompt ids, where they are from) for `--prompts FILE`."""
    requests, report = read_requests(path)
    detail = "; ".join([f"{len(requests)} requests read from {path}", *report.lines()])
    checks = [Check("requests", "warn" if report.total else "pass", detail)]
    checks.append(check_system_prompt(requests, load_splits(recipe).train))
    checks.append(check_rendering(requests, target.tokenizer, recipe.data.chat_template_kwargs))
    chosen = requests[: recipe.eval.num_prompts]
    prompts = [Chat.of(target, r.kwargs).prompt_ids(r.messages) for r in chosen]
    return checks, prompts, f"{len(chosen)} requests of {path.name}"


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
    verifier, architectures = written_verifier(recipe, target_config, resolve_origin(recipe.target)[1])
    # the K is a serving choice (`export` may write the measured best): the fresh write takes the export's own
    k = proposal_k(on_disk) or loaded.family.draft_tokens(loaded.draft, recipe.eval.num_speculative_tokens)
    dtype = served_dtype(on_disk, recipe.export.dtype)
    fresh = fmt.write(loaded.draft, dtype, verifier, architectures, k)
    checks = check_export(loaded, fmt, export, on_disk, fresh)
    if (check := engines.get(engine).doctor()) is not None:
        checks.append(check(ServedExport(recipe, loaded, fmt, export, on_disk, fresh, target_config, dtype)))
    return checks


def k_checks(
    recipe: Recipe, target: Target, loaded: LoadedDraft, suite: Suite, served: int | None, options: DoctorOptions
) -> tuple[list[Check], list[dict]]:
    """(checks, the newest verify run's records): the K its loop record recommends, at batch 1 and at
    `options.batch`, and against a sweep of the loop at every K when asked."""
    report = latest_verify_report(recipe, loaded.path)
    record = loop_record(report[1]) if report else None
    where = str(verify_dir(recipe.run_dir))
    checks = [check_k(record, where, served), *skipped_records(report)]
    if options.batch > 1 and measured(record):
        assert record is not None
        costs = batch_costs(target, record, options.batch, suite.prompts[0].ids)
        checks.append(check_k(record, where, served, (options.batch, costs)))
    if options.sweep:
        max_new = recipe.eval.max_new_tokens or suite.config.max_new_tokens
        k = loaded.family.draft_tokens(loaded.draft, recipe.eval.num_speculative_tokens)
        checks.append(check_sweep(sweep_k(target, loaded.path, suite, k, max_new, recipe.seed)))
    return checks, report[1] if report else []


def skipped_records(report: VerifyReport | None) -> list[Check]:
    """A warning naming the records of a verify run that its readers left out (`export.records`), if any."""
    notes = skipped_notes(report)
    fix = (
        "rerun `speculators-train verify <recipe>`: the results file was edited, damaged or written by another version"
    )
    return [Check(f"verify records of {report.path}", "warn", notes[0], fix)] if report and notes else []


def engine_checks(recipe: Recipe, loaded: LoadedDraft, served: int | None, engine: str) -> list[Check]:
    """The K and the free baselines of each engine's newest verify run of this checkpoint (`engine`, the one
    served, is named as skipped where it has none)."""
    checks = []
    for name in engines.verifying():  # each engine `verify` runs keeps records of its own
        report = latest_verify_report(recipe, loaded.path, name)
        if report is not None:
            batches = sorted({r.get("batch", 1) for r in report[1]} | {1})
            ours = served if name == engine else None  # the export's K is for the engine it is checked for
            checks += [check_engine_k(report[1], name, str(report[0]), ours, b) for b in batches]
            checks.append(check_engine_baselines(report[1], name))
            checks += skipped_records(report)
        elif name == engine:
            fix = f"run `speculators-train verify <recipe>` with eval.engine: {name} to measure K and the free "
            fix += f"baselines in {name} itself"
            checks.append(Check(f"K in {name}", "skip", f"no {name} verify run of {loaded.path}", fix))
    return checks


def defer_to_engine(loop: list[Check], engines: list[Check], engine: str) -> list[Check]:
    """The loop's K checks, then the engines'. Where the served engine measured K itself, its check decides the K
    to serve (as `export` does) and the loop's stand as information."""
    if not any(c.name.startswith(f"K in {engine}") and c.status != "skip" for c in engines):
        return loop + engines
    note = f"; the loop's costs, not {engine}'s: its own run decides (K in {engine})"
    loop = list(loop)
    for i, c in enumerate(loop):
        if c.status == "warn" and (c.name == "K" or c.name.startswith("K at batch")):
            loop[i] = replace(c, status="pass", detail=c.detail + note, fix="")
    return loop + engines


def doctor(
    recipe: Recipe,
    export: Path | None,
    checkpoint: Path | None,
    engine: str,
    out_dir: Path | None,
    options: DoctorOptions = DoctorOptions(),
) -> tuple[Path, list[Check]]:
    """Every check, written to `out_dir` (default <run dir>/doctor/<timestamp>)."""
    export = export or export_dir(recipe.run_dir) / recipe.export.format
    on_disk = read_json_object(export / "config.json", "export config") if (export / "config.json").is_file() else None
    target = load_target(recipe.target)
    loaded = load_draft(checkpoint or checkpoints_dir(recipe.run_dir), target.num_layers)
    check_fits(loaded, target.hidden_size, target.vocab_size, target.num_layers)
    checks = serve_checks(recipe, loaded, export, on_disk, engine)
    identity = target.identity()
    suite = first_suite(recipe, target)
    max_new = recipe.eval.max_new_tokens or suite.config.max_new_tokens
    prompts, where = [p.ids for p in suite.prompts], f"{len(suite.prompts)} prompts of {suite.config.name}"
    if options.prompts is not None:
        found, prompts, where = request_checks(recipe, target, options.prompts)
        checks += found
    served = proposal_k(on_disk or {})
    k = loaded.family.draft_tokens(loaded.draft, served or recipe.eval.num_speculative_tokens)
    acceptance = loop_checks(target, loaded, prompts, max_new, k, where)
    found, records = k_checks(recipe, target, loaded, suite, served, options)
    record = loop_record(records)
    del target
    serve_dtype = served_dtype(on_disk or {}, recipe.export.dtype)
    checks += check_data(recipe.hidden_states_dir, identity, serve_dtype)
    checks.append(check_verifier(on_disk, recipe.hidden_states_dir, target_fingerprint(recipe.target)))
    checks.append(check_vocab_map(recipe.hidden_states_dir, loaded))
    checks += acceptance
    checks.append(check_exposure(record, held_out_metrics(loaded.path)))
    checks.append(check_suites(records))
    checks.append(check_baseline(records, record))
    metrics, k_asked = train_dir(recipe.run_dir) / METRICS, recipe.eval.num_speculative_tokens
    checks.append(check_curve(curve_points(metrics, k_asked), k_asked, metrics))
    checks += defer_to_engine(found, engine_checks(recipe, loaded, served, engine), engine)
    out_dir = out_dir or doctor_dir(recipe.run_dir) / time.strftime("%Y%m%d-%H%M%S")
    write(out_dir, checks, f"doctor: {recipe.source_path}, {engine}")
    return out_dir, checks
