"""Train against serve: the export on disk against what the trained checkpoint writes, field by field and tensor
by tensor, and as the engine's own config reader takes both (vLLM's `SpeculatorsConfig`), so a field edited,
dropped or read differently is named with the value trained and the value the engine will use."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from speculators_train.doctor.report import Check
from speculators_train.families.base import ExportFormat, LoadedDraft
from speculators_train.families.format_common import read_weights

# Written for people and tools, not read by an engine as a setting of the draft
BOOKKEEPING = ("transformers_version", "speculators_version", "speculators_train_version")
MISSING = "<missing>"
# the verifier's provenance, which `data.check_verifier` judges against the target served now
PROVENANCE = ("speculators_config.verifier.revision", "speculators_config.verifier.config_hash")


def flat(config: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted path: value} of a JSON config's leaves (lists are leaves)."""
    if not isinstance(config, dict):
        return {prefix: config}
    out: dict[str, Any] = {}
    for key, value in config.items():
        out.update(flat(value, f"{prefix}{key}." if isinstance(value, dict) and value else f"{prefix}{key}"))
    return {k.rstrip("."): v for k, v in out.items()}


def config_diffs(trained: dict[str, Any], exported: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(field, trained value, exported value) for each leaf that differs, bookkeeping left out."""
    a, b = flat(trained), flat(exported)
    keys = sorted(k for k in set(a) | set(b) if k.split(".")[-1] not in BOOKKEEPING and k not in PROVENANCE)
    return [(k, a.get(k, MISSING), b.get(k, MISSING)) for k in keys if a.get(k, MISSING) != b.get(k, MISSING)]


def tensor_diffs(trained: dict[str, torch.Tensor], exported: dict[str, torch.Tensor]) -> list[str]:
    out = [f"{name}: not in the export" for name in sorted(set(trained) - set(exported))]
    out += [f"{name}: in the export only" for name in sorted(set(exported) - set(trained))]
    for name in sorted(set(trained) & set(exported)):
        mine, theirs = trained[name], exported[name]
        if mine.shape != theirs.shape:
            out.append(f"{name}: shape {list(theirs.shape)}, trained {list(mine.shape)}")
        elif not torch.equal(mine.to(theirs.dtype), theirs):
            changed = (mine.to(theirs.dtype) != theirs).sum().item()
            out.append(f"{name}: {changed} of {theirs.numel()} values differ from the trained draft's")
    return out


def vllm_reading(config: dict[str, Any]) -> dict[str, Any] | None:
    """The draft config vLLM builds from a speculators-format config.json (its own reader); None for a config its
    speculators reader does not take (another layout, or a type vLLM reads with a config class of its own)."""
    from vllm.transformers_utils.configs.speculators.algos import SUPPORTED_SPECULATORS_TYPES
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    if config.get("speculators_model_type") not in SUPPORTED_SPECULATORS_TYPES:
        return None
    return SpeculatorsConfig.extract_transformers_pre_trained_config(copy.deepcopy(config))


def check_export(
    loaded: LoadedDraft,
    fmt: ExportFormat,
    export: Path,
    on_disk: dict[str, Any],
    fresh: tuple[dict[str, Any], dict[str, torch.Tensor]],
) -> list[Check]:
    """The export at `export` (its config.json: `on_disk`) against `fresh` (what the checkpoint `loaded` writes in
    `fmt`)."""
    config, tensors = fresh
    weights, _ = read_weights(export)
    checks = []
    diffs = config_diffs(config, on_disk)
    lines = [f"{k}: trained {a!r}, the export has {b!r}" for k, a, b in diffs]
    checks.append(
        Check(
            f"{fmt.name} config.json as trained",
            "fail" if lines else "pass",
            "; ".join(lines) or f"every field of {export / 'config.json'} is the trained draft's",
            f"export again from {loaded.path} (`speculators-train export --force`)" if lines else "",
        )
    )
    bad = tensor_diffs(tensors, weights)
    checks.append(
        Check(
            f"{fmt.name} tensors as trained",
            "fail" if bad else "pass",
            "; ".join(bad[:8]) + (f"; and {len(bad) - 8} more" if len(bad) > 8 else "")
            if bad
            else f"{len(weights)} tensors equal the trained draft's",
            f"export again from {loaded.path}; a vocabulary map (d2t/t2d) must come from the training manifest's "
            "token counts"
            if bad
            else "",
        )
    )
    return checks


def check_vllm(on_disk: dict[str, Any], fresh_config: dict[str, Any]) -> Check:
    """vLLM's reader on the export and on what the checkpoint writes: a field it reads differently from training
    (edited or dropped from the file, where vLLM then falls back to its default) is named with both values, and
    a field of the trained config its reader does not carry over at all is a warning."""
    try:
        theirs, ours = vllm_reading(on_disk), vllm_reading(fresh_config)
    except (KeyError, ValueError, TypeError) as exc:
        return Check("vLLM reads the export as trained", "fail", f"vLLM's reader refuses it: {exc}", "export again")
    if theirs is None or ours is None:
        return Check("vLLM reads the export as trained", "skip", "vLLM's speculators reader does not take this "
                     "export (it reads it with the model's own config class)")  # fmt: skip
    wrong = config_diffs(ours, theirs)
    if wrong:
        detail = "; ".join(f"{k}: trained {a!r}, vLLM will use {b!r}" for k, a, b in wrong)
        return Check("vLLM reads the export as trained", "fail", detail, "export again from the checkpoint")
    dropped = sorted(
        k
        for k, v in fresh_config.items()
        if not isinstance(v, dict) and k not in BOOKKEEPING and k not in ours and v not in (None, False, [], {})
        and k not in ("architectures", "speculators_model_type", "torch_dtype", "dtype")
    )  # fmt: skip
    if dropped:
        detail = "vLLM's reader does not carry " + ", ".join(f"{k}={fresh_config[k]!r}" for k in dropped)
        fix = "check that vLLM's draft model applies these another way, or train without them"
        return Check("vLLM reads the export as trained", "warn", detail, fix)
    return Check("vLLM reads the export as trained", "pass", f"{len(ours)} fields as trained")


def check_sglang(fmt: ExportFormat, loaded: LoadedDraft, on_disk: dict[str, Any], target_num_layers: int) -> Check:
    """The export as SGLang's loader reads it (its rules, applied here: SGLang does not run on this machine)."""
    name = "SGLang reads the export as trained"
    diffs = fmt.sglang_reading(loaded.draft, on_disk, target_num_layers)
    if diffs is None:
        return Check(name, "skip", f"SGLang does not load the {fmt.name} format of a {loaded.family.title}")
    if diffs:
        lines = [f"{field}: trained {a!r}, SGLang will use {b!r}" for field, a, b in diffs]
        return Check(name, "fail", "; ".join(lines), f"export again from {loaded.path} (`--format sglang --force`)")
    return Check(name, "pass", "aux layer ids after SGLang's +1, vocabulary, lm_head and norm flags as trained")
