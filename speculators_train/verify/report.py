"""Scores (as vLLM counts them) and the outputs of a verify run: JSON, Markdown, PNG.

For verify step t with K drafted positions (a tree counts its depth), a_t is the number of accepted drafts:
    acceptance length      AL  = 1 + mean(a_t)          (the +1 is the target's correction or bonus token)
    per-position rate      r_i = mean(a_t >= i + 1)      so AL = 1 + sum_i r_i
    draft acceptance rate      = sum(a_t) / (steps * K)
a_t is what the target accepted, counted before the output is cut at EOS or the token limit (as vLLM's
sampler counts it), so the last step of a sequence may count drafts that were not emitted.

Two ALs, as peers report them: `acceptance_length` pools every verify step of every request (vLLM's and SGLang's
metrics); `acceptance_length_per_request_mean` is the mean of each request's own AL (SpecForge's benchmark). They
differ when requests accept unevenly, so a comparison with a peer's figure must use the same one.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from speculators_train.files import atomic_write_bytes, to_json
from speculators_train.layout import ACCEPTANCE_PLOT, RESULTS, RESULTS_REPORT
from speculators_train.verify.decoder import Generation


def acceptance(accepted: list[int], k: int) -> dict[str, Any]:
    steps = len(accepted)
    if steps == 0:
        return {"acceptance_length": None, "per_position_acceptance": [], "draft_acceptance_rate": None, "steps": 0}
    return {
        "acceptance_length": 1 + sum(accepted) / steps,
        "per_position_acceptance": [sum(a > i for a in accepted) / steps for i in range(k)],
        "draft_acceptance_rate": sum(accepted) / (steps * k),
        "steps": steps,
    }


def quartiles(values: list[float]) -> list[float]:
    if len(values) < 2:
        return values * 3
    return statistics.quantiles(values, n=4, method="inclusive")


def per_request_al(values: list[float | None]) -> dict[str, Any]:
    """The mean of each request's own AL (SpecForge's definition) over the requests that drafted, and each request's
    AL: None for one that drafted nothing, or whose counts were its batch's."""
    known = [al for al in values if al is not None]
    return {
        "acceptance_length_per_request_mean": sum(known) / len(known) if known else None,
        "per_prompt_acceptance_length": values,
    }


def first_divergence(spec: list[int], base: list[int]) -> int | None:
    """Index of the first token where two outputs differ (None: identical); an engine's greedy records give it per
    prompt, since its output can fork from target-only decoding with the verify batch width."""
    for i, (a, b) in enumerate(zip(spec, base, strict=False)):
        if a != b:
            return i
    return None if len(spec) == len(base) else min(len(spec), len(base))


def score(
    suite: str,
    shape: str,
    k: int,
    temperature: float,
    top_p: float,
    speculative: list[Generation],
    baseline: list[Generation],
) -> dict[str, Any]:
    """One suite x setting record. Times are sums over the prompts; tokens/s = tokens / wall time. The quartiles
    of the per-prompt speedups (each prompt against its own baseline, run next to it) show how much of the overall
    speedup is spread between prompts and machine noise rather than the draft."""
    accepted = [a for g in speculative for a in g.accepted]
    spec_tokens = sum(len(g.tokens) for g in speculative)
    base_tokens = sum(len(g.tokens) for g in baseline)
    spec_s = sum(g.seconds for g in speculative)
    base_s = sum(g.seconds for g in baseline)
    spec_rate, base_rate = spec_tokens / spec_s, base_tokens / base_s
    phases = {
        "prefill": sum(g.prefill_seconds for g in speculative),
        "draft": sum(g.draft_seconds for g in speculative),
        "verify": sum(g.verify_seconds for g in speculative),
    }
    phases["bookkeeping"] = max(spec_s - sum(phases.values()), 0.0)
    record = {
        "suite": suite,
        "shape": shape,
        "num_speculative_tokens": k,
        "temperature": temperature,
        "top_p": top_p,
        "prompts": len(speculative),
        **acceptance(accepted, k),
        **per_request_al([acceptance(g.accepted, k)["acceptance_length"] for g in speculative]),
        "tokens": spec_tokens,
        "target_only_tokens_per_s": base_rate,
        "speculative_tokens_per_s": spec_rate,
        "speedup": spec_rate / base_rate,
        "per_prompt_speedup_quartiles": quartiles(
            [
                (len(g.tokens) / g.seconds) / (len(b.tokens) / b.seconds)
                for g, b in zip(speculative, baseline, strict=True)
            ]
        ),
        "seconds": {"speculative": spec_s, "target_only": base_s, **{f"spec_{name}": v for name, v in phases.items()}},
    }
    if temperature == 0:
        same = sum(g.tokens == b.tokens for g, b in zip(speculative, baseline, strict=True))
        record["greedy_identical_outputs"] = f"{same}/{len(speculative)}"
    return record


def speedup_cell(record: dict[str, Any]) -> str:
    """'1.29x (1.10-1.41)': the overall speedup and the per-prompt lower and upper quartiles."""
    low, _, high = record["per_prompt_speedup_quartiles"]
    return f"{record['speedup']:.2f}x ({low:.2f}-{high:.2f})"


def engine_cell(record: dict[str, Any]) -> str:
    """'native', 'llama.cpp (SmolLM2...Q4_1.gguf)' or 'vllm (batch 8)': who decoded, from which target file, how
    many requests at once."""
    engine = record.get("engine", "native")
    if record.get("target_file"):
        return f"{engine} ({record['target_file']})"
    return f"{engine} (batch {record['batch']})" if record.get("batch") else engine


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def markdown(records: list[dict[str, Any]]) -> str:
    """The records as a table; "AL pooled" is over every verify step, "AL per-request mean" the mean of each
    request's AL (`-` where the engine counts only the whole run)."""
    head = (
        "| engine | suite | shape | T | prompts | AL pooled | AL per-request mean | per-position acceptance "
        "| draft acc. rate | steps | target-only tok/s | spec tok/s | speedup (prompt IQR) | draft / verify / other s "
        "| greedy identical |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for r in records:
        s = r["seconds"]
        if "spec_draft" in s:
            phases = f"{s['spec_draft']:.1f} / {s['spec_verify']:.1f} / {s['spec_prefill'] + s['spec_bookkeeping']:.1f}"
        else:  # an engine that times only the whole decode
            phases = "-"
        rows.append(
            f"| {engine_cell(r)} | {r['suite']} | {r['shape']} | {r['temperature']:g} | {r['prompts']} "
            f"| {r['acceptance_length']:.2f} | {_number(r.get('acceptance_length_per_request_mean'))} "
            f"| {' '.join(f'{x:.2f}' for x in r['per_position_acceptance'])} | {r['draft_acceptance_rate']:.3f} "
            f"| {r['steps']} | {r['target_only_tokens_per_s']:.1f} | {r['speculative_tokens_per_s']:.1f} "
            f"| {speedup_cell(r)} | {phases} | {r.get('greedy_identical_outputs', '-')} |"
        )
    return head + "\n".join(rows) + "\n"


def plot(records: list[dict[str, Any]], path: Path) -> None:
    """Per-position acceptance (left) and speedup (right), one line/bar per record."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = []
    for r in records:
        engine = f"{r['engine']}/{r.get('target', '')} " if r.get("engine") else ""
        label = f"{engine}{r['suite']} {r['shape']} T={r['temperature']:g}"
        labels.append(label)
        rates = r["per_position_acceptance"]
        left.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{label} (AL {r['acceptance_length']:.2f})")
    left.set_xlabel("draft position")
    left.set_ylabel("acceptance rate (accepted at least this far)")
    left.set_ylim(0, 1.02)
    left.legend(fontsize=7)
    right.barh(range(len(records)), [r["speedup"] for r in records])
    right.axvline(1.0, color="grey", linestyle="--")
    right.set_yticks(range(len(records)), labels, fontsize=7)
    right.set_xlabel("speedup over target-only decoding")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def write_outputs(out_dir: Path, records: list[dict[str, Any]]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out_dir / RESULTS, (to_json(records, indent=2) + "\n").encode())
    atomic_write_bytes(out_dir / RESULTS_REPORT, markdown(records).encode())
    plot(records, out_dir / ACCEPTANCE_PLOT)
