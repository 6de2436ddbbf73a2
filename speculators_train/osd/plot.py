"""The acceptance plot of an `osd` run, drawn from its history."""

from __future__ import annotations

import json
import os
from pathlib import Path


def plot(history: Path, out: Path) -> None:
    """Acceptance length vs records seen: each window's traffic under the version serving it, and each update's
    log-slice AL before/after."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in history.read_text().splitlines() if line.strip()]
    fig, ax = plt.subplots(figsize=(7, 4))
    seen = [r["records_seen"] for r in rows]
    ax.plot(seen, [r["window_al"] for r in rows], "o-", label="traffic window (current draft)")
    updates = [r for r in rows if "log_al" in r]
    ax.plot([r["records_seen"] for r in updates], [r["log_al"] for r in updates], "s--", label="log slice, current")
    at = [r["records_seen"] for r in updates]
    ax.plot(at, [r["candidate_log_al"] for r in updates], "^:", label="log slice, candidate")
    ax.plot(at, [r["general_al"] for r in updates], "x-.", label="general, current")
    for r in updates:
        if r["promoted"]:
            ax.axvline(r["records_seen"], color="grey", alpha=0.3)
    ax.set_xlabel("log records seen")
    ax.set_ylabel("acceptance length (teacher-forced)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, out)
