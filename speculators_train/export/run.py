"""`speculators-train export`: a trained draft as a directory a serving engine loads.

    <out>/config.json, model.safetensors, tokenizer files, README.md (a card: target, data, budget, measured AL)

The directory is written beside <out> and renamed into place, so a reader never sees half an export, and an
existing <out> is replaced only when asked (`--force`).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from speculators_train import __version__
from speculators_train.errors import UserError
from speculators_train.export import medusa, sglang, speculators
from speculators_train.export.drafts import check_fits, fill_embedding, load_any_draft
from speculators_train.files import read_json
from speculators_train.hidden_states.shards import MANIFEST
from speculators_train.models.eagle3 import Eagle3Draft
from speculators_train.models.medusa import MedusaDraft
from speculators_train.recipe import Recipe
from speculators_train.target import load_head_weights, resolve_source

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ENGINES = {"speculators": "vLLM (`vllm serve`) and the `speculators` library", "sglang": "SGLang (EAGLE3)"}
MEDUSA_ENGINES = "vLLM releases with the `medusa` method (`MedusaModel`), and speculators-style readers"


@dataclass
class Exported:
    path: Path
    format: str
    verifier: str
    commands: list[str]
    notes: list[str]


def export_weights(draft: Eagle3Draft, dtype: torch.dtype, rename=lambda name: name) -> dict[str, torch.Tensor]:
    """Float tensors in `dtype`; the vocabulary maps stay int64 (d2t offsets) and bool (t2d), whatever `dtype` is."""
    out = {}
    for name, tensor in draft.state_dict().items():
        if name == "d2t":
            tensor = tensor.to(torch.int64)
        elif name == "t2d":
            tensor = tensor.to(torch.bool)
        else:
            tensor = tensor.to(dtype)
        out[rename(name)] = tensor.detach().cpu().contiguous()
    return out


def serve_commands(fmt: str, out: Path, verifier: str, recipe: Recipe, heads: int | None = None) -> list[str]:
    """The engine command lines; `heads` is set for Medusa, which vLLM takes only through --speculative-config."""
    ev = recipe.eval
    if heads is not None:
        spec = {"model": str(out), "method": "medusa", "num_speculative_tokens": min(ev.num_speculative_tokens, heads)}
        return [f"vllm serve {verifier} --speculative-config '{json.dumps(spec)}'"]
    if fmt == "speculators":
        spec = {"model": str(out), "method": "eagle3", "num_speculative_tokens": ev.num_speculative_tokens}
        return [
            f"vllm serve {shlex.quote(str(out))}",
            f"vllm serve {verifier} --speculative-config '{json.dumps(spec)}'",
        ]
    if ev.mode == "tree":
        steps, topk, tokens = ev.tree.depth, ev.tree.top_k, ev.tree.budget + 1
    else:
        steps, topk, tokens = ev.num_speculative_tokens, 1, ev.num_speculative_tokens + 1
    return [
        f"python -m sglang.launch_server --model-path {verifier} --speculative-algorithm EAGLE3 "
        f"--speculative-draft-model-path {shlex.quote(str(out))} --speculative-num-steps {steps} "
        f"--speculative-eagle-topk {topk} --speculative-num-draft-tokens {tokens}"
    ]


def latest_verify_report(recipe: Recipe, checkpoint: Path) -> tuple[Path, list[dict[str, Any]]] | None:
    """The newest `verify` results measured on this very checkpoint, if any."""
    root = recipe.run_dir / "verify"
    for results in sorted(root.glob("*/results.json"), reverse=True):
        try:
            records = read_json(results, "verify results")
        except UserError:
            continue
        if records and all(Path(r.get("checkpoint", "")).resolve() == checkpoint.resolve() for r in records):
            return results, records
    return None


def _settings(draft: Eagle3Draft | MedusaDraft, fmt: str, recipe: Recipe) -> list[tuple[str, str]]:
    """The card's architecture rows."""
    cfg = draft.config
    if isinstance(draft, MedusaDraft):
        return [
            ("target states read", "the last decoder layer's output after the final norm"),
            ("heads", f"{cfg.num_heads} (head h proposes the token h+2 after the last verified one)"),
            ("residual blocks per head", str(cfg.num_layers)),
            ("draft vocabulary", f"{cfg.draft_vocab_size} of {cfg.target_vocab_size} target ids (`token_map`)"),
            ("speculative tokens", str(min(recipe.eval.num_speculative_tokens, cfg.num_heads))),
        ]
    ids = f"{cfg.aux_layer_ids} (the residual stream entering layer k, as vLLM counts)"
    if fmt == "sglang":
        ids += f"; written as {[i - 1 for i in cfg.aux_layer_ids]} in `eagle_config`, as SGLang counts"
    return [
        ("target states read", ids),
        ("draft vocabulary", f"{cfg.draft_vocab_size} of {cfg.target_vocab_size} target ids"),
        ("speculative tokens", str(recipe.eval.num_speculative_tokens)),
        ("norm_before_residual", str(cfg.norm_before_residual).lower()),
    ]


def model_card(
    recipe: Recipe,
    draft: Eagle3Draft | MedusaDraft,
    fmt: str,
    dtype: str,
    verifier: str,
    checkpoint: Path,
    commands: list[str],
) -> str:
    is_medusa = isinstance(draft, MedusaDraft)
    lines = [
        f"# {'Medusa heads' if is_medusa else 'EAGLE-3 draft'} for {verifier}",
        "",
        f"Exported by speculators_train {__version__} in the `{fmt}` format, for "
        f"{MEDUSA_ENGINES if is_medusa else ENGINES[fmt]}.",
        "",
        "| setting | value |",
        "|---|---|",
        f"| target (verifier) | `{verifier}` |",
        *(f"| {name} | {value} |" for name, value in _settings(draft, fmt, recipe)),
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
        splits = read_json(manifest, "hidden-state manifest").get("splits", {})
        for split, info in splits.items():
            lines.append(
                f"- {split}: {info.get('records')} records, {info.get('samples')} samples, {info.get('tokens')} tokens"
            )
    lines += ["", "## Training budget", ""]
    state_file = checkpoint / "trainer_state.json"
    if state_file.is_file():
        state = read_json(state_file, "trainer state")
        t = recipe.training
        lines.append(
            f"Step {state.get('step')} (epoch {state.get('epoch')}), {state.get('tokens')} tokens seen; "
            f"lr {t.learning_rate:g}, {t.batch_size} samples x {t.gradient_accumulation_steps} accumulation x "
            f"{(state.get('identity') or {}).get('world_size', 1)} ranks per step"
            + ("." if is_medusa else f", {recipe.eagle3.ttt_steps} TTT steps.")
        )
        if state.get("best"):
            best = state["best"]
            lines.append(f"Best held-out {best['metric']}: {best['value']:.3f} (step {best['step']}).")
    else:
        lines.append(f"Imported from `{checkpoint}` (made by another tool); its training budget is not recorded.")
    lines += ["", "## Measured acceptance", ""]
    report = latest_verify_report(recipe, checkpoint)
    if report is None:
        lines.append(f"Not measured yet: `speculators-train verify {recipe.source_path} --draft {checkpoint}`.")
    else:
        results, records = report
        lines.append(f"From `{results}` (`speculators-train verify`, real target, {records[0].get('device')}):")
        lines += ["", "| suite | shape | T | acceptance length | speedup |", "|---|---|---|---|---|"]
        for r in records:
            lines.append(
                f"| {r['suite']} | {r['shape']} | {r['temperature']} | {r['acceptance_length']:.2f} | "
                f"{r['speedup']:.2f}x |"
            )
    lines += ["", "## Serve", "", "```", *commands, "```", ""]
    return "\n".join(lines)


def _replace(tmp: Path, out: Path) -> None:
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def export(
    recipe: Recipe,
    checkpoint: Path | None = None,
    fmt: str | None = None,
    out: Path | None = None,
    dtype: str | None = None,
    force: bool = False,
) -> Exported:
    fmt = fmt or recipe.export.format
    dtype = dtype or recipe.export.dtype
    if fmt not in ENGINES:
        raise UserError(f"--format {fmt!r}: expected one of {sorted(ENGINES)}")
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: expected one of {sorted(DTYPES)}")
    out = out or recipe.run_dir / "export" / fmt
    if out.exists() and not force:
        raise UserError(f"{out} already exists; pass --force to replace it")
    source, hub_id = resolve_source(recipe.target)
    target_config, head = load_head_weights(recipe.target)
    num_layers = target_config.num_hidden_layers
    draft, has_embedding, checkpoint = load_any_draft(
        checkpoint or recipe.run_dir / "train" / "checkpoints", num_layers
    )
    check_fits(checkpoint, draft.config, target_config.hidden_size, target_config.vocab_size, num_layers)
    fill_embedding(draft, has_embedding, head["embed"])
    is_medusa = isinstance(draft, MedusaDraft)
    if fmt == "sglang" and is_medusa:
        raise UserError(f"{checkpoint}: Medusa heads; SGLang has no Medusa speculator, use --format speculators")
    if fmt == "sglang" and (problems := sglang.unsupported(draft.config)):
        raise UserError(f"{checkpoint}: cannot export for SGLang: {'; '.join(problems)}")

    verifier = recipe.export.verifier or hub_id or recipe.target.name_or_path
    notes = []
    if hub_id is None and not recipe.export.verifier:
        notes.append(
            f"verifier {verifier!r} is a local path: a serving machine must have it there too, and vLLM's "
            "one-argument `vllm serve <dir>` needs a hub id (set export.verifier)"
        )
    commands = serve_commands(fmt, out, verifier, recipe, draft.config.num_heads if is_medusa else None)
    architectures = list(getattr(target_config, "architectures", None) or ["LlamaForCausalLM"])
    k = recipe.eval.num_speculative_tokens
    if is_medusa:
        config = medusa.medusa_config(draft.config, verifier, architectures, k, dtype)
        weights = medusa.medusa_weights(draft, DTYPES[dtype])
    elif fmt == "speculators":
        config = speculators.speculators_config(draft.config, verifier, architectures, k, dtype)
        weights = export_weights(draft, DTYPES[dtype])
    else:
        config = sglang.sglang_config(draft.config, dtype)
        weights = export_weights(draft, DTYPES[dtype], sglang.weight_name)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp / "model.safetensors", 0o666 & ~umask)  # safetensors writes 0600; a server may run as another user
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(source, revision=recipe.target.revision).save_pretrained(tmp)
        card = model_card(recipe, draft, fmt, dtype, verifier, checkpoint, commands)
        (tmp / "README.md").write_text(card)
        _replace(tmp, out)
    except OSError as exc:
        raise UserError(f"could not write the export to {out}: {exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Exported(out, fmt, verifier, commands, notes)
