"""Doctor for vLLM: the export and what the checkpoint writes now, each through vLLM's own config reader
(`SpeculatorsConfig`), so a field vLLM reads otherwise than trained is named with both values."""

from __future__ import annotations

import copy
from typing import Any

from speculators_train.doctor.report import Check
from speculators_train.doctor.serve import BOOKKEEPING, ServedExport, config_diffs


def check(served: ServedExport) -> Check:
    """`check_vllm` where vLLM is installed."""
    try:
        return check_vllm(served.on_disk, served.fresh[0])
    except ImportError:
        return Check("vLLM reads the export as trained", "skip", "vLLM is not installed here")


def vllm_reading(config: dict[str, Any]) -> dict[str, Any] | None:
    """The draft config vLLM builds from a speculators-format config.json (its own reader); None for a config its
    speculators reader does not take (another layout, or a type vLLM reads with a config class of its own)."""
    from vllm.transformers_utils.configs.speculators.algos import SUPPORTED_SPECULATORS_TYPES
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    if config.get("speculators_model_type") not in SUPPORTED_SPECULATORS_TYPES:
        return None
    return SpeculatorsConfig.extract_transformers_pre_trained_config(copy.deepcopy(config))


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
