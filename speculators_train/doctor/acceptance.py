"""Acceptance explained: the draft vocabulary's ceiling on the target's own greedy tokens, and the loop's acceptance
against what teacher-forced validation predicted in training."""

from __future__ import annotations

from typing import Any

from speculators_train.doctor.report import Check
from speculators_train.families.base import LoadedDraft
from speculators_train.families.objective import predicted_al_key
from speculators_train.families.vocab import draft_to_target

CEILING_WARN = 0.05  # a share of greedy tokens outside the draft vocabulary worth a user's attention


def draft_ids(loaded: LoadedDraft) -> set[int] | None:
    """The target ids the draft can propose (None: every one, a draft without a vocabulary map)."""
    d2t = getattr(loaded.draft, "d2t", None)
    return None if d2t is None else set(draft_to_target(d2t.cpu()).tolist())


def check_vocabulary(loaded: LoadedDraft, greedy: list[list[int]], where: str) -> Check:
    """The share of the target's greedy tokens (on `where`'s prompts) that the draft cannot propose: a position
    whose next token is outside its vocabulary is never accepted, whatever the training."""
    inside = draft_ids(loaded)
    if inside is None:
        return Check("draft vocabulary covers the target's tokens", "pass", "the draft proposes every target id")
    tokens = [t for reply in greedy for t in reply]
    if not tokens:
        return Check("draft vocabulary covers the target's tokens", "skip", f"no greedy tokens on {where}")
    outside = sum(1 for t in tokens if t not in inside)
    share = outside / len(tokens)
    detail = f"{outside} of the target's {len(tokens)} greedy tokens on {where} ({share:.1%}) are outside the "
    detail += f"draft's {len(inside)}-token vocabulary"
    if share > CEILING_WARN:
        fix = "build the vocabulary from data like these prompts (a larger draft_vocab_size, or this data in the mix)"
        return Check("draft vocabulary covers the target's tokens", "warn", detail, fix)
    return Check("draft vocabulary covers the target's tokens", "pass", detail)


def check_exposure(record: dict[str, Any] | None, held_out: dict[str, Any]) -> Check:
    """The loop's AL against the AL teacher-forced validation predicted at the same K: drafting from its own
    drafts (exposure bias), a train-serve difference or held-out data unlike the suites show as a gap."""
    name = "loop acceptance against training's prediction"
    if record is None:
        return Check(name, "skip", "no verify run of this checkpoint", "run `speculators-train verify <recipe>`")
    k = record["num_speculative_tokens"]
    predicted = held_out.get(predicted_al_key(k))
    if predicted is None:
        return Check(name, "skip", f"the checkpoint holds no held-out prediction at K={k}")
    loop = record["acceptance_length"]
    detail = f"loop AL {loop:.2f} on {record['suite']} at K={k}, T={record['temperature']:g}; teacher-forced "
    detail += f"validation predicted {predicted:.2f}"
    if loop - 1 < 0.8 * (predicted - 1):
        fix = (
            "a gap this large is a train-serve difference (the checks above), held-out data unlike the suites, "
            "or exposure bias: train more steps on the draft's own outputs (TTT depth)"
        )
        return Check(name, "warn", detail, fix)
    return Check(name, "pass", detail)


def check_baseline(records: list[dict[str, Any]], record: dict[str, Any] | None) -> Check:
    """The draft's loop `record` against the draftless n-gram lookup decoded beside it in the same verify run: a
    draft no faster than prompt lookup on these prompts did not pay for its training here."""
    name = "draft against the free n-gram baseline"
    free = next((r for r in records if record and str(r.get("shape", "")).startswith("ngram")
                 and r.get("suite") == record.get("suite") and r.get("temperature") == 0), None)  # fmt: skip
    if record is None or free is None:
        fix = "run `speculators-train verify <recipe>` with eval.baselines: [ngram] (the default)"
        return Check(name, "skip", "no verify run of this checkpoint with an n-gram record", fix)
    detail = f"on {record['suite']}: the draft AL {record['acceptance_length']:.2f}, {record['speedup']:.2f}x; "
    detail += f"n-gram lookup AL {free['acceptance_length']:.2f}, {free['speedup']:.2f}x"
    if free["speedup"] >= record["speedup"]:
        fix = "prompt lookup is as fast on these prompts: train on more data like them, or serve vLLM's `ngram` "
        fix += "method (llama.cpp: --spec-type ngram-*) instead of this draft"
        return Check(name, "warn", detail, fix)
    return Check(name, "pass", detail)


def check_suites(records: list[dict[str, Any]]) -> Check:
    """The draft's greedy loop records of the verify run suite by suite (both AL definitions, speedup): a suite
    accepting under half the drafts per step of the best one is data the training mix lacks."""
    name = "acceptance by suite"
    ours = [r for r in records if r.get("engine", "native") == "native" and r.get("temperature") == 0
            and str(r.get("shape", "")).startswith(("chain", "tree"))]  # fmt: skip
    if not ours:
        return Check(name, "skip", "no greedy loop record of this checkpoint", "run `speculators-train verify`")
    cells = [
        f"{r['suite']} AL {r['acceptance_length']:.2f} pooled, "
        f"{r.get('acceptance_length_per_request_mean') or r['acceptance_length']:.2f} per-request mean, "
        f"{r['speedup']:.2f}x"
        for r in ours
    ]
    best = max(r["acceptance_length"] for r in ours)
    low = [r["suite"] for r in ours if r["acceptance_length"] - 1 < 0.5 * (best - 1)]
    if low:
        fix = f"{', '.join(low)}: under half the accepted drafts per step of the best suite; add data like it to "
        fix += "the mix"
        return Check(name, "warn", "; ".join(cells), fix)
    return Check(name, "pass", "; ".join(cells))


def check_engine_baselines(records: list[dict[str, Any]], engine: str) -> Check:
    """The draft against `engine`'s own draftless methods (vLLM `ngram`/`suffix`, llama.cpp's n-gram types), suite
    by suite at T = 0, from one verify run in that engine: the fastest K of each against the fastest baseline."""
    name = f"draft against {engine}'s free baselines"
    greedy = [r for r in records if r.get("engine") == engine and r.get("temperature") == 0 and r.get("batch", 1) == 1]
    drafts = [r for r in greedy if str(r.get("shape", "")).startswith(("chain", "tree"))]
    free = [r for r in greedy if r not in drafts]
    if not drafts or not free:
        return Check(name, "skip", f"no {engine} verify run of this checkpoint with a draftless method beside it")
    cells, beaten = [], []
    for suite in dict.fromkeys(r["suite"] for r in drafts):
        ours = max((r for r in drafts if r["suite"] == suite), key=lambda r: r["speedup"])
        theirs = max((r for r in free if r["suite"] == suite), key=lambda r: r["speedup"], default=None)
        if theirs is None:
            continue
        cells.append(
            f"{suite}: draft {ours['shape']} {ours['speedup']:.2f}x, {theirs['shape']} {theirs['speedup']:.2f}x"
        )
        if theirs["speedup"] >= ours["speedup"]:
            beaten.append(suite)
    if beaten:
        fix = f"on {', '.join(beaten)} {engine}'s draftless method is as fast: train on more data like these prompts, "
        fix += "or serve that method there"
        return Check(name, "warn", "; ".join(cells), fix)
    return Check(name, "pass", "; ".join(cells) or "no suite has both")
