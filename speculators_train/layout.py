"""Every on-disk name of a run, in one place: a stage reads another stage's files through these paths and readers,
so the dependency is an import the layering test sees, and a rename is one edit (`tests/unit/test_layering.py`
fails on a run file named anywhere else).

    <training.output_dir>/
      train/metrics.jsonl                      the trainer's log
      train/run_info.json                      what made the run (command line, commit, versions, recipe); also in
                                               hidden_states/ and each verify/<time>/
      train/checkpoints/step-000120/           one checkpoint: model.safetensors, draft_config.json (the draft's
                                               files, families/drafts.py), optimizer.pt, trainer_state.json, and
                                               under FSDP2 optimizer-rank00000-of-00002.pt, ... (a rank's slice)
      train/checkpoints/.shards-000120/        FSDP2: each rank's slice, staged before rank 0 moves them in
      train/checkpoints/latest.json            {"step": 120}: rewritten atomically after the directory lands
      train/checkpoints/best.json              {"step": 80, "metric": ..., "value": ...}
      verify/<time>/results.json, results.md, acceptance.png    one `verify` run's records
      export/<format>/                         what `export` writes
      doctor/<time>/doctor.md, doctor.json     one `doctor` run's checks
      osd/                                     online distillation (osd/distill.py says what each holds):
        ingest/state.json, ingest/segments/000000.jsonl      exactly-once ingestion (osd/ingest.py)
        progress.json, general.json, history.jsonl, acceptance.png
        versions/v0000/checkpoint/, versions/v0000/<format>/, current -> versions/v0000, trainee/step-000003/
      hidden_states/                           manifest.json, token_freq.safetensors, progress/rank000.json (the
                                               shards' own names are `hidden_states/shards.py`'s: the manifest
                                               lists them)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from speculators_train.errors import UserError
from speculators_train.loading import read_json_object, shown

WEIGHTS = "model.safetensors"
DRAFT_CONFIG = "draft_config.json"
TRAINER_STATE = "trainer_state.json"
OPTIMIZER = "optimizer.pt"
LATEST = "latest.json"
BEST = "best.json"
METRICS = "metrics.jsonl"
RESULTS = "results.json"
RESULTS_REPORT = "results.md"
ACCEPTANCE_PLOT = "acceptance.png"  # verify's per-run plot, and OSD's acceptance over records seen
RUN_INFO = "run_info.json"
DOCTOR_REPORT = "doctor.md"
DOCTOR_RESULTS = "doctor.json"
MANIFEST = "manifest.json"  # the hidden states' index: the commit point of `generate`
TOKEN_FREQ = "token_freq.safetensors"
OSD_PROGRESS = "progress.json"  # OSD's commit point
OSD_GENERAL = "general.json"
OSD_HISTORY = "history.jsonl"
INGEST_STATE = "state.json"  # ingestion's commit point
_SHARD_STAGING = ".shards-"


def train_dir(run_dir: Path) -> Path:
    return run_dir / "train"


def checkpoints_dir(run_dir: Path) -> Path:
    return train_dir(run_dir) / "checkpoints"


def verify_dir(run_dir: Path) -> Path:
    return run_dir / "verify"


def export_dir(run_dir: Path) -> Path:
    return run_dir / "export"


def doctor_dir(run_dir: Path) -> Path:
    return run_dir / "doctor"


def osd_dir(run_dir: Path) -> Path:
    return run_dir / "osd"


def hidden_states_dir(run_dir: Path) -> Path:
    return run_dir / "hidden_states"


def ingest_dir(osd: Path) -> Path:
    return osd / "ingest"


def segments_dir(ingest: Path) -> Path:
    return ingest / "segments"


def segment_name(index: int) -> str:
    """The `index`-th segment of ingested records (the ingestion state lists the committed ones)."""
    return f"{index:06d}.jsonl"


def trainee_dir(osd: Path) -> Path:
    """OSD's draft in training: a checkpoints/ directory of its own."""
    return osd / "trainee"


def versions_dir(osd: Path) -> Path:
    return osd / "versions"


def version_dir(osd: Path, version: int) -> Path:
    return versions_dir(osd) / f"v{version:04d}"


def versions(osd: Path) -> dict[int, Path]:
    """OSD's version directories, by number (other entries there are not versions)."""
    found = versions_dir(osd).glob("v*")
    return {int(p.name[1:]): p for p in found if p.name[1:].isdigit()}


def version_checkpoint(version: Path) -> Path:
    """A version's checkpoint (ours), beside its export in the recipe's format."""
    return version / "checkpoint"


def current_version(osd: Path) -> Path:
    """The link to the promoted version, re-pointed atomically."""
    return osd / "current"


def generation_progress(hidden_states: Path, rank: int) -> Path:
    """One rank's record of the shards it wrote, read when `generate` resumes and when it writes the manifest."""
    return hidden_states / "progress" / f"rank{rank:03d}.json"


def step_dir(checkpoints: Path, step: int) -> Path:
    return checkpoints / f"step-{step:06d}"


def shard_name(rank: int, world: int) -> str:
    """The file of a checkpoint holding one rank's slice of the optimizer state (FSDP2)."""
    return f"optimizer-rank{rank:05d}-of-{world:05d}.pt"


def shard_staging(checkpoints: Path, step: int) -> Path:
    """Where each rank writes its slice of a checkpoint before rank 0 moves them in (FSDP2)."""
    return checkpoints / f"{_SHARD_STAGING}{step:06d}"


def shard_stagings(checkpoints: Path) -> list[Path]:
    """The staging directories there, a killed save's included."""
    return sorted(checkpoints.glob(f"{_SHARD_STAGING}*"))


def read_pointer(path: Path) -> dict[str, Any] | None:
    """A checkpoints/ pointer (`LATEST`, `BEST`), None when absent; its `step` is an integer >= 0."""
    if not path.is_file():
        return None
    pointer = read_json_object(path, "checkpoint pointer")
    step = pointer.get("step")
    if type(step) is not int or step < 0:
        raise UserError(f"{path}: checkpoint pointer: step must be an integer >= 0, got {shown(step)}")
    return pointer


def is_complete(checkpoint: Path) -> bool:
    return all((checkpoint / name).is_file() for name in (WEIGHTS, DRAFT_CONFIG, TRAINER_STATE))


def latest_checkpoint(checkpoints: Path) -> Path | None:
    """The checkpoint `LATEST` names; if that one is gone or incomplete, the newest complete one."""
    pointer = read_pointer(checkpoints / LATEST)
    if pointer is not None and is_complete(step_dir(checkpoints, pointer["step"])):
        return step_dir(checkpoints, pointer["step"])
    complete = sorted((p for p in checkpoints.glob("step-*") if is_complete(p)), key=lambda p: p.name)
    return complete[-1] if complete else None


def best_or_latest(path: Path) -> Path | None:
    """The checkpoint a checkpoints/ directory or a run directory stands for: its best, else its latest."""
    for root in (path, path / "checkpoints", checkpoints_dir(path)):
        pointer = read_pointer(root / BEST)
        if pointer is not None and step_dir(root, pointer["step"]).is_dir():
            return step_dir(root, pointer["step"])
        latest = latest_checkpoint(root) if root.is_dir() else None
        if latest is not None:
            return latest
    return None


def step_dirs(checkpoints: Path) -> list[int]:
    """The steps of the checkpoint directories there, oldest first."""
    return sorted(int(p.name[5:]) for p in checkpoints.glob("step-*") if p.is_dir())


def read_trainer_state(checkpoint: Path) -> dict[str, Any] | None:
    """A checkpoint's trainer state (step, data position, identity, held-out metrics), None where it has none (a
    draft another tool made)."""
    path = checkpoint / TRAINER_STATE
    return read_json_object(path, "trainer state") if path.is_file() else None


def held_out_metrics(checkpoint: Path) -> dict[str, Any]:
    """The held-out metrics a checkpoint was saved with ({} where it has none)."""
    held_out = (read_trainer_state(checkpoint) or {}).get("held_out")
    return held_out if isinstance(held_out, dict) else {}


def verify_results(run_dir: Path) -> list[Path]:
    """Every `verify` run's results file of a run, newest first."""
    return sorted(verify_dir(run_dir).glob(f"*/{RESULTS}"), reverse=True)
