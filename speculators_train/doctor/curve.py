"""The learning curve: the held-out predicted AL at each validation of the run (the trainer's metrics log), and
what one more doubling of training would buy where the curve has not flattened."""

from __future__ import annotations

import json
import math
from pathlib import Path

from speculators_train.doctor.report import Check
from speculators_train.families.objective import predicted_al_key

FLAT = 0.02  # AL gained per doubling of steps under which the curve counts as flat
SHOWN = 8  # points printed at most


def curve_points(metrics: Path, k: int) -> list[tuple[int, float]]:
    """(step, held-out predicted AL at K = `k`) per validation, the last record of a step winning (a resumed run
    logs a step again); a line cut by a kill is left out."""
    key = f"val/{predicted_al_key(k)}"
    points: dict[int, float] = {}
    try:
        lines = metrics.read_text(errors="replace").splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get(key), float) and isinstance(record.get("step"), int):
            points[record["step"]] = record[key]
    return sorted(points.items())


def check_curve(points: list[tuple[int, float]], k: int, where: Path) -> Check:
    name = "learning curve"
    if len(points) < 2 or points[-1][0] <= points[0][0]:
        return Check(name, "skip", f"{len(points)} validation(s) with a predicted AL at K={k} in {where}",
                     "set training.eval_every_steps to validate during training")  # fmt: skip
    last_step, last = points[-1]
    earlier = [p for p in points if p[0] <= last_step / 2] or points[:1]
    step, then = earlier[-1]
    gain = (last - then) / math.log2(last_step / step)
    shown = points[:: max(1, math.ceil(len(points) / SHOWN))]
    shown += [] if shown[-1] == points[-1] else [points[-1]]
    detail = f"held-out predicted AL at K={k} by step: " + ", ".join(f"{s}: {a:.2f}" for s, a in shown)
    detail += f"; {gain:+.2f} per doubling of the steps since step {step}"
    if gain > FLAT:
        fix = f"the curve has not flattened: about {gain:+.2f} AL per doubling of training (more data, or more "
        fix += "epochs on it) is still to be had"
        return Check(name, "warn", detail, fix)
    return Check(name, "pass", f"{detail}: flat, more of the same data would buy little")
