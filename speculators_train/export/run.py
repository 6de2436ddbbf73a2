"""`speculators-train export`: a trained draft as a directory a serving engine loads.

    <out>/config.json, model.safetensors, tokenizer files, README.md (a card: target, data, budget, measured AL)

The directory is written beside <out> and renamed into place, so a reader never sees half an export, and an
existing <out> is replaced only when asked (`--force`).
"""

from __future__ import annotations

import glob
import os
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from safetensors.torch import save_file

from speculators_train import __version__, engines
from speculators_train.architectures import text_config
from speculators_train.engines.serving import served_commands
from speculators_train.errors import UserError
from speculators_train.export.k import recommended_k, served_k
from speculators_train.export.records import checked_records
from speculators_train.families.base import ExportFormat, LoadedDraft
from speculators_train.families.drafts import check_fits, load_draft, refuse_non_finite
from speculators_train.families.format_common import DTYPES, stamp_verifier
from speculators_train.files import to_json, writing
from speculators_train.head import load_head_weights
from speculators_train.layout import (
    MANIFEST,
    TRAINER_STATE,
    checkpoints_dir,
    export_dir,
    read_trainer_state,
    train_dir,
    verify_results,
)
from speculators_train.loading import read_json, read_json_object, reading
from speculators_train.origin import TargetConfig, describe_origin, gguf_file, resolve_origin, target_fingerprint
from speculators_train.recipe import Recipe
from speculators_train.runlock import exclusive
from speculators_train.training.config import TrainingConfig


@dataclass
class Exported:
    path: Path
    format: str
    verifier: str
    commands: list[str]
    notes: list[str]


class VerifyReport(NamedTuple):
    """A verify run's results file, the records fit to compute with, and one line per record skipped
    (`export.records`)."""

    path: Path
    records: list[dict[str, Any]]
    skipped: list[str]


def latest_verify_report(recipe: Recipe, checkpoint: Path, engine: str = "native") -> VerifyReport | None:
    """The newest `verify` results measured on this very checkpoint in `engine`, if any (an engine's draftless
    baselines name no checkpoint; its draft records must name this one). Records a reader cannot compute with are
    left out of `records` and named in `skipped` (all of them, for a report of damaged records only)."""
    for results in verify_results(recipe.run_dir):
        try:
            records = read_json(results, "verify results")
        except UserError:
            continue
        if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
            continue  # not a report `verify` wrote: as unreadable as a damaged one
        named = [r["checkpoint"] for r in records if isinstance(r.get("checkpoint"), str) and r["checkpoint"]]
        same = [Path(c).resolve() == checkpoint.resolve() for c in named]
        if named and all(same) and all(r.get("engine", "native") == engine for r in records):
            return VerifyReport(results, *checked_records(results, records))
    return None


def served_engine(export_format: ExportFormat, out: Path, k: int) -> str:
    """The engine whose verify runs decide an export's K: the engine of its format where that engine's records
    decide it (llama.cpp for a draft file beside a GGUF target, vLLM for a format it serves), else the native loop."""
    engine = engines.for_format(export_format.name)
    return engine.name if engine.verifies and engine.decides_k(export_format, out, k) else "native"


def serving_k(recipe: Recipe, checkpoint: Path, engine: str, asked: int, force_k: bool) -> tuple[int, list[str]]:
    """(the K an export serves, notes): from the newest verify run in the engine that serves it where that run
    measured up to `asked`, else from the loop's."""
    report = latest_verify_report(recipe, checkpoint, engine) if engine != "native" else None
    if report is None or recommended_k(report.records, asked, engine) is None:
        engine, report = "native", latest_verify_report(recipe, checkpoint)
    k, notes = served_k(report[:2] if report else None, asked, force_k, engine)
    return k, notes + skipped_notes(report)


def skipped_notes(report: VerifyReport | None) -> list[str]:
    """One note for the records a verify report's readers left out: how many, and the first one's reason."""
    if report is None or not report.skipped:
        return []
    first, more = report.skipped[0], len(report.skipped) - 1
    return [
        f"{len(report.skipped)} verify record(s) skipped, not fit to compute with: {first}"
        + (f" (and {more} more)" if more else "")
    ]


def model_card(
    recipe: Recipe,
    loaded: LoadedDraft,
    fmt: str,
    dtype: str,
    verifier: str,
    k: int,
    commands: list[str],
    fingerprint: dict[str, Any],
) -> str:
    """The export's README; `fingerprint`: the target's revision and config hash (`origin.target_fingerprint`)."""
    family, checkpoint = loaded.family, loaded.path
    lines = [
        f"# {family.title} for {verifier}",
        "",
        f"Exported by speculators_train {__version__} in the `{fmt}` format, for {family.formats[fmt].engines}.",
        "",
        "| setting | value |",
        "|---|---|",
        f"| target (verifier) | `{verifier}` |",
        f"| trained and measured against | {describe_origin(recipe.target)} |",
        "| target revision, config hash | {revision}, {config_hash} |".format(**fingerprint),
        *(f"| {name} | {value} |" for name, value in family.card_rows(loaded.draft, fmt, k)),
        f"| dtype | {dtype} |",
        "",
        "## Data",
        "",
        f"Mix `{recipe.data.mix}`, at most {recipe.data.max_length} tokens per sample, "
        f"{recipe.data.held_out_fraction:.0%} held out; "
        + ("replies regenerated by the target." if recipe.data.regenerate.enabled else "replies as in the data."),
    ]
    manifest = recipe.hidden_states_dir / MANIFEST
    if manifest.is_file():
        # The card reads these files' fields as `generate`, `train` and `verify` write them; one that is not (a
        # list, a missing key, a string where a number belongs) is one line naming it, not a traceback.
        with reading(manifest, "hidden-state manifest"):
            for split, info in read_json_object(manifest, "hidden-state manifest").get("splits", {}).items():
                lines.append(
                    f"- {split}: {info.get('records')} records, {info.get('samples')} samples, "
                    f"{info.get('tokens')} tokens"
                )
    lines += ["", "## Training budget", "", *_budget_lines(recipe.training, checkpoint)]
    lines += ["", "## Measured acceptance", ""]
    lines += _acceptance_lines(recipe, checkpoint)
    lines += ["", "## Serve", "", "```", *commands, "```", ""]
    return "\n".join(lines)


def _budget_lines(t: TrainingConfig, checkpoint: Path) -> list[str]:
    """The card's training budget, from the checkpoint's trainer state."""
    lines = []
    state = read_trainer_state(checkpoint)
    if state is not None:
        with reading(checkpoint / TRAINER_STATE, "trainer state"):
            identity = state.get("identity") or {}
            settings = ", ".join(f"{key} {value}" for key, value in (identity.get("draft") or {}).items())
            lines.append(
                f"Step {state.get('step')} (epoch {state.get('epoch')}), {state.get('tokens')} tokens seen; "
                f"lr {t.learning_rate:g}, {t.batch_size} samples x {t.gradient_accumulation_steps} accumulation x "
                f"{identity.get('world_size', 1)} ranks per step"
                + (f"; draft settings: {settings}." if settings else ".")
            )
            if state.get("best"):
                best = state["best"]
                lines.append(f"Best held-out {best['metric']}: {best['value']:.3f} (step {best['step']}).")
    else:
        lines.append(f"Imported from `{checkpoint}` (made by another tool); its training budget is not recorded.")
    return lines


def _acceptance_lines(recipe: Recipe, checkpoint: Path) -> list[str]:
    """The card's measured acceptance, from the newest `verify` results on this checkpoint."""
    lines = []
    report = latest_verify_report(recipe, checkpoint)
    if report is None or not report.records:
        lines.append(f"Not measured yet: `speculators-train verify {recipe.source_path} --draft {checkpoint}`.")
    else:
        results, records, _ = report
        lines.append(f"From `{results}` (`speculators-train verify`, real target, {records[0].get('device')}):")
        lines += ["", "| suite | shape | T | acceptance length | speedup |", "|---|---|---|---|---|"]
        with reading(results, "verify results"):
            for r in records:
                lines.append(
                    f"| {r['suite']} | {r['shape']} | {r['temperature']} | {_al(r.get('acceptance_length'))} | "
                    f"{r['speedup']:.2f}x |"
                )
    return lines


def _al(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def local_config_dir(source: str, revision: str | None) -> Path:
    """The target's config and tokenizer files as a local directory (a hub id is fetched without its weights)."""
    if Path(source).is_dir():
        return Path(source)
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.model", "*.txt", "*.tiktoken"]
    return Path(snapshot_download(source, revision=revision, allow_patterns=patterns))


def llamacpp_converter() -> Path:
    from speculators_train.engines.llamacpp.build import home
    from speculators_train.engines.llamacpp.converter import CONVERTER

    return home() / "convert" / CONVERTER[0]


def _replace(tmp: Path, out: Path) -> None:
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def check_out(out: Path, reads: list[Path], force: bool) -> None:
    """Refuse an output directory whose replacement would delete what the export reads (the checkpoint, the run,
    the target) or a directory that is not an export: `--force` replaces a previous export, nothing else."""
    real = out.resolve()
    for read in map(Path.resolve, reads):
        if _inside(read, real) or _inside(real, read):
            how = "holds" if _inside(read, real) else "is inside"
            raise UserError(f"--out {out}: it {how} {read}, which the export reads")
    if not out.exists():
        return
    if not force:
        raise UserError(f"{out} already exists; pass --force to replace it")
    weights = [*out.glob("*.safetensors"), *out.glob("*.gguf")] if out.is_dir() else []
    if not ((out / "README.md").is_file() and weights):
        raise UserError(f"--out {out} is not an export of this toolkit; --force replaces only a previous export")


def export(
    recipe: Recipe,
    checkpoint: Path | None = None,
    fmt: str | None = None,
    out: Path | None = None,
    dtype: str | None = None,
    force: bool = False,
    force_k: bool = False,
) -> Exported:
    """Write the draft at `checkpoint` (default: the recipe's best) in its family's format `fmt` (default:
    export.format)."""
    fmt = fmt or recipe.export.format
    dtype = dtype or recipe.export.dtype
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: expected one of {sorted(DTYPES)}")
    out = out or export_dir(recipe.run_dir) / fmt
    source, hub_id = resolve_origin(recipe.target)
    checkpoint_dir = checkpoint or checkpoints_dir(recipe.run_dir)
    local_target = [Path(source)] if Path(source).exists() else []
    reads = [checkpoint_dir, recipe.hidden_states_dir, train_dir(recipe.run_dir), *local_target]
    check_out(out, reads, force)
    with exclusive(out, "export"):  # after the checks, so a refused --out gets no lock file beside it
        check_out(out, reads, force)  # again: another export may have finished meanwhile
        return _export(recipe, out, fmt, dtype, (source, hub_id), checkpoint_dir, force_k)


def written_verifier(recipe: Recipe, target_config: Any, hub_id: str | None) -> tuple[str, list[str]]:
    """(the verifier's name, its architectures) as an export writes them."""
    verifier = recipe.export.verifier or hub_id or recipe.target.name_or_path
    return verifier, list(getattr(target_config, "architectures", None) or ["LlamaForCausalLM"])


def _target_gguf(target: TargetConfig, source: str) -> tuple[str, list[str]]:
    """The target as an engine that loads a draft file beside it names it (its GGUF file, not a hub id), and a note
    on making that file where the target is not one."""
    target_gguf = gguf_file(target)
    if target_gguf is not None:
        return str(target_gguf), []
    served = f"{Path(source).name}.gguf"
    make = shlex.join(["python", str(llamacpp_converter()), str(source), "--outfile", served, "--outtype", "bf16"])
    return served, [f"the target is not a GGUF file: make {served} once with llama.cpp's converter ({make})"]


def _staging(out: Path) -> Path:
    """A new, empty staging folder beside `out`, after removing those a killed export left (another pid's): this
    process holds the lock on `out`, so none of them is in use."""
    for stale in out.parent.glob(f".{glob.escape(out.name)}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.mkdir()
    return tmp


def _export(
    recipe: Recipe, out: Path, fmt: str, dtype: str, origin: tuple[str, str | None], checkpoint_dir: Path, force_k: bool
) -> Exported:
    source, hub_id = origin
    target_config, head = load_head_weights(recipe.target)
    text = text_config(target_config)
    num_layers = text.num_hidden_layers
    loaded = load_draft(checkpoint_dir, num_layers)
    check_fits(loaded, text.hidden_size, text.vocab_size, num_layers)
    family, draft = loaded.family, loaded.draft
    family.attach_target(draft, head["embed"], loaded.has_embedding)
    export_format = family.formats.get(fmt)
    if export_format is None:
        raise UserError(f"{loaded.path}: a {family.name} draft; its export formats are {list(family.formats)}")
    if problems := export_format.unsupported(draft):
        raise UserError(f"{loaded.path}: cannot export in the {fmt} format: {'; '.join(problems)}")

    verifier, architectures = written_verifier(recipe, target_config, hub_id)
    served, notes = (verifier, []) if not export_format.draft_file else _target_gguf(recipe.target, source)
    if hub_id is None and not recipe.export.verifier:
        notes.append(
            f"verifier {verifier!r} is a local path: a serving machine must have it there too, and vLLM's "
            "one-argument `vllm serve <dir>` needs a hub id (set export.verifier)"
        )
    asked = family.draft_tokens(draft, recipe.eval.num_speculative_tokens)
    k, more = serving_k(recipe, loaded.path, served_engine(export_format, out, asked), asked, force_k)
    notes += more
    lines = export_format.commands(out, served, recipe.eval, k)
    nextn = export_format.vllm_mtp_classes(draft)
    commands, more = served_commands(recipe.target, target_config, family.settings, lines, nextn)
    notes += more
    config, weights = export_format.write(draft, dtype, verifier, architectures, k)
    fingerprint = target_fingerprint(recipe.target)
    stamp_verifier(config, fingerprint)
    refuse_non_finite(weights, f"{loaded.path} in {dtype}")  # float16 overflows past 65504

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _staging(out)
    try:
        with writing(out, cleanup=tmp):  # a full disk ends as every other writer's does
            (tmp / "config.json").write_text(to_json(config, indent=2) + "\n")
            save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
            umask = os.umask(0)
            os.umask(umask)
            # safetensors writes 0600; a server may run as another user
            os.chmod(tmp / "model.safetensors", 0o666 & ~umask)
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(source, revision=recipe.target.revision).save_pretrained(tmp)
            export_format.finish(tmp, local_config_dir(source, recipe.target.revision), dtype)
            card = model_card(recipe, loaded, fmt, dtype, verifier, k, commands, fingerprint)
            (tmp / "README.md").write_text(card)
            _replace(tmp, out)
    except OSError as exc:
        raise UserError(f"could not write the export to {out}: {exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Exported(out, fmt, verifier, commands, notes)
