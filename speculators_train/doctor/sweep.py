"""A brute-force K sweep: the verify loop at chain K = 1..K on the same prompts, each prompt's target-only
baseline and every K decoded back to back (`run_paired`), so that `doctor`'s K can be checked against it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tqdm import tqdm

from speculators_train.proposal import Sampling
from speculators_train.target import Target
from speculators_train.verify.decoder import SpeculativeDecoder
from speculators_train.verify.report import score
from speculators_train.verify.run import load_draft_for, reuse, run_paired, verify_packing, warm_up
from speculators_train.verify.suites import Suite


def sweep_k(
    target: Target, checkpoint: Path, suite: Suite, max_k: int, max_new: int, seed: int
) -> list[dict[str, Any]]:
    """Greedy loop records of the draft at `checkpoint` at K = 1..max_k (at most what it proposes per step),
    smallest K first."""
    loaded = load_draft_for(target, checkpoint)
    family, draft = loaded.family, loaded.draft
    ks = sorted({family.draft_tokens(draft, k) for k in range(1, max_k + 1)})
    sampling = Sampling()
    with verify_packing(target, draft, [(k, None) for k in ks]):
        decoders = [SpeculativeDecoder(target, family.proposer(draft, target), sampling, k) for k in ks]
        warm_up(target, decoders[-1], suite)
        with tqdm(total=(len(ks) + 1) * len(suite.prompts), unit="prompt", desc="K sweep") as bar:
            baseline, runs = run_paired(target, suite, max_new, sampling, seed, bar, [reuse(d) for d in decoders])
    return [
        score(suite.config.name, f"chain(K={k})", k, 0.0, 1.0, spec, baseline) for k, spec in zip(ks, runs, strict=True)
    ]
