"""`speculators-train <command> <recipe>` (also `python -m speculators_train`, under accelerate/torchrun)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table
from rich.text import Text

from speculators_train import engines
from speculators_train.data.conversations import SkipReport
from speculators_train.errors import UserError, interrupted, os_error, terminate_like_interrupt
from speculators_train.eval_config import ENGINE_CHOICES
from speculators_train.files import to_json
from speculators_train.layout import DOCTOR_REPORT, DOCTOR_RESULTS, checkpoints_dir, ingest_dir, osd_dir, train_dir
from speculators_train.recipe import Recipe, load_recipe
from speculators_train.runlock import exclusive
from speculators_train.schema import parse_overrides

# Never markup: paths, names and messages print as written (a `[/]` in a path is text, not a closing tag).
console = Console(stderr=True, markup=False)


def _recipe(args: argparse.Namespace, target: bool = True) -> Recipe:
    """The recipe with the command line's overrides; with `target`, also held to what its family can make for the
    target (its config read, no weights), so a stage refuses before doing any work."""
    overrides = parse_overrides(args.set)
    if getattr(args, "engine", None):
        overrides["eval.engine"] = args.engine
    if getattr(args, "format", None):  # checked against the draft family's formats when the recipe loads
        overrides["export.format"] = args.format
    recipe = load_recipe(args.recipe, overrides)
    if target:
        from speculators_train.head import logit_transform
        from speculators_train.target import load_target_config

        config = load_target_config(recipe.target)
        if problems := recipe.draft.target_problems(config):
            raise UserError(f"{recipe.source_path}: " + "; ".join(problems))
        logit_transform(config)  # a head training cannot reproduce is refused here, not after generate
    return recipe


def cmd_data(args: argparse.Namespace) -> int:
    """Read the recipe's data mix, render it with the target's chat template (its tokenizer, and a multimodal
    target's processor; no weights) and report record, sample and token counts and every skip."""
    from speculators_train.data.splits import load_splits, no_held_out, rendered_counts
    from speculators_train.target import load_processor, load_tokenizer

    recipe = _recipe(args)
    splits = load_splits(recipe)
    rendered = rendered_counts(recipe.data, splits, load_tokenizer(recipe.target), *load_processor(recipe.target))
    counts = {
        "train": len(splits.train),
        "held_out": len(splits.held_out),
        **{key: {split: rendered[split][key] for split in rendered} for key in ("samples", "tokens", "loss_tokens")},
        "skipped": splits.report.counts,
    }
    print(to_json(counts))
    for line in splits.report.lines():
        console.print(line, highlight=False)
    if why := no_held_out(recipe, splits):
        console.print(f"warning: {why}", highlight=False)
    for split, numbers in rendered.items():
        if numbers["records"] and not numbers["samples"]:
            raise UserError(splits.report.nothing_left(str(recipe.source_path), split, numbers["records"]))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from speculators_train.distributed import process_state
    from speculators_train.hidden_states.generator import generate

    recipe = _recipe(args)
    process_state()  # the process group first: it decides which rank holds the lock
    with exclusive(recipe.hidden_states_dir, "generate"):
        manifest = generate(recipe)
    if manifest:
        _report_generation(recipe, manifest)
    return 0


def _report_generation(recipe: Recipe, manifest: dict) -> None:
    table = Table(title=f"hidden states in {recipe.hidden_states_dir}")
    for column in ("split", "records", "samples", "tokens", "loss tokens", "shards"):
        table.add_column(column, justify="right")
    for split, info in manifest["splits"].items():
        table.add_row(
            split,
            str(info["records"]),
            str(info["samples"]),
            str(info["tokens"]),
            str(info["loss_tokens"]),
            str(sum(1 for s in info["shards"] if s["num_samples"])),
        )
    console.print(table)
    for line in SkipReport.from_dict(manifest["skips"]).lines():
        console.print(line, highlight=False)


def cmd_validate(args: argparse.Namespace) -> int:
    from speculators_train.hidden_states.shards import validate

    path = Path(args.recipe)
    directory = path if path.is_dir() else _recipe(args, target=False).hidden_states_dir
    problems = validate(directory)
    for problem in problems:
        _labelled("invalid", "red", problem)
    if not problems:
        console.print(f"{directory}: every shard matches the manifest")
    return 1 if problems else 0


def cmd_train(args: argparse.Namespace) -> int:
    from speculators_train.training.strategies import accelerator, for_recipe
    from speculators_train.training.trainer import Trainer

    recipe = _recipe(args)
    strategy = for_recipe(recipe)
    accelerator(recipe, strategy)  # the process group first: it decides which rank holds the lock
    with exclusive(train_dir(recipe.run_dir), "train"):
        trainer = Trainer(recipe, strategy)
        metrics = trainer.train()
    if trainer.accelerator.is_main_process:
        _report_training(trainer, metrics)
    return 0


def _report_training(trainer, metrics: dict[str, float]) -> None:
    from speculators_train.families.objective import key

    family = trainer.family
    table = Table(title=f"held-out metrics after step {trainer.state['step']} ({trainer.ckpt_dir})")
    for column in (family.step_label, *trainer.columns):
        table.add_column(column, justify="right")
    for i in range(trainer.chain_length):
        table.add_row(str(i), *(f"{metrics[key(name, i)]:.3f}" for name in trainer.columns))
    console.print(table)
    console.print(f"predicted acceptance length at {trainer.al_depth} draft tokens: {metrics[trainer.al_key]:.2f}")
    print(to_json({"step": trainer.state["step"], "tokens": trainer.state["tokens"], **metrics}))


def cmd_verify(args: argparse.Namespace) -> int:
    from speculators_train.verify.report import markdown
    from speculators_train.verify.run import verify

    recipe = _recipe(args)
    draft = Path(args.draft) if args.draft else checkpoints_dir(recipe.run_dir)
    out_dir, records = verify(recipe, draft, Path(args.out) if args.out else None)
    print(markdown(records))
    for record in records:
        print(to_json({k: v for k, v in record.items() if k != "per_prompt_acceptance_length"}))
    console.print(f"results, recipe and plot: {out_dir}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from speculators_train.export.run import export

    recipe = _recipe(args)
    done = export(
        recipe,
        Path(args.checkpoint) if args.checkpoint else None,
        None,
        Path(args.out) if args.out else None,
        args.dtype,
        args.force,
        args.force_k,
    )
    console.print(f"exported {done.format} draft for {done.verifier} to {done.path}")
    for note in done.notes:
        _labelled("note", "yellow", note)
    if done.commands:  # none where no engine serves this draft on this target (the notes say why)
        console.print("serve it with:")
    for command in done.commands:
        print(command)
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    """Exit 1 when a check fails (a draft the engine would run otherwise than trained, data the server renders
    otherwise), after printing every check with its fix."""
    from speculators_train.doctor.report import failed
    from speculators_train.doctor.run import DoctorOptions, doctor

    recipe = _recipe(args, target=False)
    engine = args.serve_engine or engines.for_format(recipe.export.format).name
    out_dir, checks = doctor(
        recipe,
        Path(args.draft) if args.draft else None,
        Path(args.checkpoint) if args.checkpoint else None,
        engine,
        Path(args.out) if args.out else None,
        DoctorOptions(args.batch, args.sweep, Path(args.prompts) if args.prompts else None),
    )
    colours = {"pass": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}
    out = Console(markup=False, soft_wrap=True)  # whole lines: a field's values are never cut at the width
    for c in checks:
        out.print(Text.assemble((f"{c.status:>4}", colours[c.status]), f"  {c.name}: {c.detail}"), highlight=False)
        if c.fix:
            out.print(f"      fix: {c.fix}", highlight=False)
    console.print(f"report: {out_dir / DOCTOR_REPORT} and {DOCTOR_RESULTS}")
    return 1 if failed(checks) else 0


def cmd_osd(args: argparse.Namespace) -> int:
    """Ingest production logs exactly once; unless --ingest-only, score, distil and promote (polling with --watch)."""
    recipe = _recipe(args)
    cfg = recipe.osd
    logs = args.logs or cfg.logs
    if not logs:
        raise UserError(f"{recipe.source_path}: no logs directory: pass --logs DIR or set osd.logs")
    logs_dir = Path(logs) if args.logs else recipe.resolve_path(logs, "osd.logs", directory=True)
    root = osd_dir(recipe.run_dir)
    with exclusive(root, "osd"):
        return _osd(args, recipe, logs_dir, root)


def _osd(args: argparse.Namespace, recipe: Recipe, logs_dir: Path, root: Path) -> int:
    import time

    from speculators_train.osd.ingest import IngestStats, LogIngestor
    from speculators_train.osd.redact import Redactor

    cfg = recipe.osd
    distiller = None
    if not args.ingest_only:
        from speculators_train.osd.distill import OnlineDistiller

        distiller = OnlineDistiller(recipe, logs_dir)
    while True:
        if distiller is None:
            ingestor = LogIngestor(
                logs_dir, ingest_dir(root), Redactor(cfg.redact, cfg.redact_builtin, cfg.redact_hook), cfg.commit_every
            )
            _report_ingest(ingestor.run(), ingestor.state)
        else:
            for record in distiller.run():
                _report_window(record)
            _report_ingest(distiller.last_ingest or IngestStats(), distiller.ingestor.state)
        if not args.watch:
            return 0
        time.sleep(cfg.poll_seconds)


def _report_ingest(stats, state: dict) -> None:
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(stats.reasons.items()))
    line = f"ingested {stats.records} new records from {stats.files} files, quarantined {stats.quarantined}"
    line += f" ({reasons})" if reasons else ""
    line += f"; {state['records']} records and {state['quarantined']} quarantined in all"
    if stats.pending_bytes:
        line += f"; {stats.pending_bytes} bytes of unfinished lines left for the next pass"
    console.print(line, highlight=False)
    for note in stats.notes:
        _labelled("note", "yellow", note)


def _report_window(record: dict) -> None:
    window = "-" if record["window_al"] is None else f"{record['window_al']:.3f}"
    line = f"records {record['records_seen']}: traffic AL {window} under v{record['version']}"
    if "promoted" in record:
        line += f"; update {'promoted' if record['promoted'] else 'kept the current draft'}: {record['reason']}"
    console.print(line, highlight=False)


COMMANDS = {
    "data": (cmd_data, "read the data mix and report record counts and skips"),
    "generate": (cmd_generate, "run the target over the data and store its hidden states (resumable)"),
    "train": (cmd_train, "train the draft from the generated hidden states (resumes from the last checkpoint)"),
    "validate": (cmd_validate, "check every hidden-state shard against the manifest (recipe or directory)"),
    "verify": (cmd_verify, "speculative decoding with the real target: acceptance length, speedup, exactness"),
    "export": (cmd_export, "write the draft in a format its engine loads (vLLM, SGLang), with tokenizer and a card"),
    "doctor": (cmd_doctor, "why a served draft accepts less: the export as the engine reads it, data, K"),
    "osd": (cmd_osd, "online distillation on production logs: ingest, score, distil, promote a better draft"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="speculators-train", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging, tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (func, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("recipe", help="recipe YAML (e.g. recipes/eagle3.yaml)")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a recipe key")
        if name == "verify":
            p.add_argument("--draft", help="checkpoint dir, or a checkpoints/run dir (its best); default: the recipe's")
            p.add_argument("--out", help="output dir; default <run dir>/verify/<timestamp>")
            p.add_argument("--engine", choices=ENGINE_CHOICES, help="default: eval.engine")
        if name == "export":
            p.add_argument(
                "--checkpoint", help="checkpoint dir, checkpoints/run dir (its best), or a draft made elsewhere"
            )
            p.add_argument(
                "--format", help="a format of the draft's family (speculators, sglang, gguf); default: export.format"
            )
            p.add_argument("--out", help="output dir; default <run dir>/export/<format>")
            p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], help="default: export.dtype")
            p.add_argument("--force", action="store_true", help="replace an existing output dir")
            p.add_argument(
                "--force-k", action="store_true",
                help="serve eval.num_speculative_tokens even where a verify run measured a smaller K faster",
            )  # fmt: skip
        if name == "doctor":
            p.add_argument("--draft", help="the export to check; default <run dir>/export/<export.format>")
            p.add_argument("--checkpoint", help="the trained checkpoint it came from; default: the recipe's best")
            p.add_argument(
                "--engine", dest="serve_engine", choices=engines.names(),
                help="the engine that serves it; default: the one export.format is for",
            )  # fmt: skip
            p.add_argument("--out", help="report dir; default <run dir>/doctor/<timestamp>")
            p.add_argument("--batch", type=int, default=1, help="also the best K at this many concurrent requests")
            p.add_argument("--sweep", action="store_true", help="measure K = 1..K with the loop and compare")
            p.add_argument("--prompts", help="real requests (OpenAI chat bodies, JSONL) to check and decode")
        if name == "osd":
            p.add_argument("--logs", help="directory of JSONL logs; default: osd.logs")
            p.add_argument("--watch", action="store_true", help="keep polling for new files and lines")
            p.add_argument("--ingest-only", action="store_true", help="ingest and redact, no scoring or training")
        p.set_defaults(func=func)
    return parser


def _error(message: str) -> None:
    """The one line a refused command prints: never folded at the console's width (a log or a pipe keeps it whole),
    and the message's own brackets are text, not markup."""
    _labelled("error", "bold red", message, soft_wrap=True)


def _labelled(label: str, style: str, text: str, soft_wrap: bool = False) -> None:
    """`label: text` with the label styled and the text as written."""
    console.print(Text.assemble((f"{label}:", style), f" {text}"), highlight=False, soft_wrap=soft_wrap)


def main(argv: list[str] | None = None) -> None:
    terminate_like_interrupt()
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(message)s",
        handlers=[RichHandler(console=console, show_path=False)],
    )
    for noisy in ("httpx", "urllib3", "datasets", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        code = args.func(args)
    except UserError as exc:
        if args.verbose:
            raise
        _error(str(exc))
        code = 2
    except OSError as exc:  # the machine, not the code: a full disk, a permission, a file where a folder belongs
        if args.verbose:
            raise
        _error(os_error(exc))
        code = 2
    except KeyboardInterrupt as exc:
        message, code = interrupted(exc)
        console.print(message)
    sys.exit(code)
