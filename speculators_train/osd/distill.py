"""Online speculative distillation: score logged traffic with the current draft, keep the records where it fails,
distil on them, and promote a new version only when it measurably helps. Any family with an objective works:
the draft's family scores, distils and exports it, through the trainer's own training step.

    <run dir>/osd/ingest/...            exactly-once log ingestion (osd/ingest.py)
    <run dir>/osd/general.json          the general suite every version is held to (eval.suites, target-answered)
    <run dir>/osd/progress.json         records consumed and seen, version, history lines: the commit point
    <run dir>/osd/versions/vNNNN/       checkpoint/ (ours) and the export in the recipe's export.format
    <run dir>/osd/trainee/step-NNNNNN/  the draft in training and its optimizer, after update NNNNNN
    <run dir>/osd/current -> versions/vNNNN     replaced atomically on promotion
    <run dir>/osd/history.jsonl         one line per window: acceptance before/after, promoted or why not
    <run dir>/osd/acceptance.png        acceptance length vs records seen
    <run dir>/osd/wandb/                the same metrics per window (training.wandb settings; offline by default)

Acceptance is scored teacher-forced on the target's own states, as training predicts it: chain j accepts at least
i+1 drafts iff draft steps 0..i all give the target's greedy token, so AL(K) = 1 + sum_i full_acc_i (the greedy
acceptance the verify loop measures on target-greedy text).
Logged responses come from the target itself, so the same holds on traffic.

The draft in training (the trainee) is not reset to the deployed version after each update: it keeps training
across windows with its optimizer state, as online distillation does, and each update offers it to the gate. A
refused candidate's steps are not lost; after `restart_after_refusals` refusals in a row it restarts from the
deployed version, so a run that went wrong cannot block promotions for good.

A kill -9 at any moment loses and repeats nothing: a window's version, trainee and history line are written before
progress.json names them, and a restart drops what it does not name (a version beyond the committed one, history lines
past the committed count, a half-written last line) and redoes the window.
"""

from __future__ import annotations

import copy
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from speculators_train.data.conversations import Conversation
from speculators_train.data.mix import is_held_out
from speculators_train.errors import UserError
from speculators_train.families import get
from speculators_train.families.base import LoadedDraft
from speculators_train.families.drafts import check_fits, load_checkpoint, load_draft
from speculators_train.files import append_line, atomic_write_bytes, atomic_write_json, to_json
from speculators_train.hidden_states.pipeline import process_chunk
from speculators_train.layout import (
    ACCEPTANCE_PLOT,
    OSD_GENERAL,
    OSD_HISTORY,
    OSD_PROGRESS,
    current_version,
    ingest_dir,
    osd_dir,
    step_dir,
    trainee_dir,
    version_checkpoint,
    version_dir,
    versions,
)
from speculators_train.loading import read_json
from speculators_train.osd.ingest import IngestStats, LogIngestor
from speculators_train.osd.plot import plot
from speculators_train.osd.redact import Redactor
from speculators_train.osd.scoring import Buffer, Sample, Scored, Scorer, gate, on_device
from speculators_train.recipe import Recipe
from speculators_train.target import StateSpec, Target, load_target
from speculators_train.tracking import init_wandb
from speculators_train.training import checkpoint as ckpt
from speculators_train.training.data import collate
from speculators_train.training.step import optimizer, train_step, trainable
from speculators_train.training.strategies import accelerator
from speculators_train.verify.suites import answered, load_suite

log = logging.getLogger(__name__)


class OnlineDistiller:
    def __init__(self, recipe: Recipe, logs: Path, target: Target | None = None) -> None:
        self.recipe, self.cfg = recipe, recipe.osd
        self.root = osd_dir(recipe.run_dir)
        self.target = target or load_target(recipe.target)
        self.family = get(recipe.draft.family)
        redact = Redactor(self.cfg.redact, self.cfg.redact_builtin, self.cfg.redact_hook)
        self.ingestor = LogIngestor(logs, ingest_dir(self.root), redact, self.cfg.commit_every)
        t = self.target
        self.head = t.head().to(next(t.model.parameters()).device)
        self.scorer = Scorer(self.family, self.head, recipe.draft, recipe.eval.num_speculative_tokens)
        self.accelerator = accelerator(recipe)
        progress = self.root / OSD_PROGRESS
        self.progress = read_json(progress, "OSD progress") if progress.is_file() else None
        if self.progress is None:
            self.draft = self._initial_draft()
        else:
            path = version_checkpoint(version_dir(self.root, self.progress["version"]))
            self.draft = self.prepare(path)
            # progress.json is the commit point: a run killed after exporting a version but before committing its
            # window left `current` ahead of it; serve the committed version again (the window is redone).
            self._point_current(self.progress["version"])
        # What samples hold: the states the draft reads, and the final state its objective distils from.
        self.states = StateSpec(self.family.states(self.draft.config).aux_layer_ids, final=True)
        self.general = self._general_samples()
        if self.progress is None:
            self._save_version(0, self.draft)
            # The general suite is held to the deployed draft's level, so small losses cannot pile up over versions.
            baseline = self._general(self.draft)
            self.progress = {"consumed": 0, "records_seen": 0, "version": 0, "updates": 0, "history_lines": 0}
            self.progress["general_baseline"] = baseline
            atomic_write_json(progress, self.progress)
        self._drop_uncommitted()
        self.trainee, self.optimizer = self._load_trainee()
        self.held_out: list[Sample] = []
        self.buffer = Buffer(self.cfg.buffer_size)
        self.last_ingest: IngestStats | None = None
        self._rebuild()

    def _rebuild(self) -> None:
        """After a restart: the held-out log slice from the entries already consumed, and the buffer as the last
        commit left it (its records run through the target again, with the scores they had), so a rerun trains on
        what an uninterrupted run would. A progress file from before the buffer was committed gets the latest
        `buffer_size` training records, scored by the current version."""
        consumed = [e for e in self.ingestor.entries() if "messages" in e][: self.progress["consumed"]]
        held = [e for e in consumed if is_held_out(e["id"], self.cfg.held_out_fraction)]
        stored = self.progress.get("buffer")
        if stored is None:
            train = [e for e in consumed if not is_held_out(e["id"], self.cfg.held_out_fraction)]
            self._take(held[: self.cfg.held_out_records] + train[-self.cfg.buffer_size :])
            return
        self._take(held[: self.cfg.held_out_records])
        records = {item["record"] for item in stored}
        entries = [e for e in consumed if e["id"] in records]
        conversations = [Conversation(e["id"], tuple(e["messages"]), e["origin"]) for e in entries]
        samples = {sample["id"]: sample for sample in self._samples(conversations)}
        self.buffer.items = [
            Scored(item["id"], samples[item["id"]], item["acceptance"], item["rejected"])
            for item in stored
            if item["id"] in samples
        ]

    def _optimizer(self, trainee: nn.Module) -> torch.optim.Optimizer:
        """The trainer's optimizer (`training.step`), at the OSD learning rate."""
        return optimizer(trainable(trainee), self.cfg.learning_rate, self.recipe.training.weight_decay)

    def _restart_trainee(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        """A trainee starting from the deployed version, with a fresh optimizer."""
        trainee = copy.deepcopy(self.draft)
        return trainee, self._optimizer(trainee)

    def _load_trainee(self) -> tuple[nn.Module, torch.optim.Optimizer]:
        """The trainee saved with the last committed update, or (before any update) one restarted from the deployed
        version."""
        step = self.progress.get("trainee")
        path = step_dir(trainee_dir(self.root), step) if step is not None else None
        if path is None or not path.is_dir():
            return self._restart_trainee()
        trainee = self.prepare(path)
        opt = self._optimizer(trainee)
        state, _ = ckpt.load_training_state(path)
        if state is not None:
            opt.load_state_dict(state)
        return trainee, opt

    def prepare(self, path: Path, loaded: LoadedDraft | None = None) -> nn.Module:
        """A draft of the recipe's family, fitted to the target and on its device (one of our checkpoints at
        `path`, unless already `loaded` from any format)."""
        t = self.target
        if loaded is None:
            family, draft = load_checkpoint(path)
            loaded = LoadedDraft(family, draft, path, False)
        if loaded.family is not self.family:
            raise UserError(
                f"{loaded.path}: a {loaded.family.name} draft, but the recipe's draft.family is {self.family.name}; "
                f"set draft.family: {loaded.family.name} (its objective settings distil it)"
            )
        check_fits(loaded, t.hidden_size, t.vocab_size, t.num_layers)
        self.family.attach_target(loaded.draft, t.embed_tokens.weight, loaded.has_embedding)
        return loaded.draft.to(next(t.model.parameters()).device).train(False)

    def _initial_draft(self) -> nn.Module:
        if not self.cfg.init_from:
            raise UserError(f"{self.recipe.source_path}: osd.init_from must name the draft to adapt (a checkpoint)")
        path = self.recipe.resolve_path(self.cfg.init_from, "osd.init_from", directory=True)
        loaded = load_draft(path, self.target.num_layers)
        return self.prepare(loaded.path, loaded)

    def _samples(self, conversations: list[Conversation]) -> list[Sample]:
        """Rendered and run through the target, keeping the states the draft's objective reads."""
        return process_chunk(self.recipe, self.target, conversations, self.recipe.seed, self.states).samples

    def _general_samples(self) -> list[Sample]:
        """The verify suites (`eval.suites`), answered greedily by the target once and frozen in osd/general.json:
        every version is held to the same text, on which teacher-forced AL is the verify loop's greedy AL."""
        path = self.root / OSD_GENERAL
        frozen = {"suites": list(self.recipe.eval.suites), "records": self.cfg.general_records}
        if path.is_file():
            stored = read_json(path, "OSD general suite")
            if {key: stored.get(key) for key in frozen} != frozen:
                raise UserError(
                    f"{path}: frozen from eval.suites {stored.get('suites')} x {stored.get('records')} records, but "
                    f"{self.recipe.source_path} now asks for {frozen['suites']} x {frozen['records']}: the gate's "
                    "baseline was measured on the old suite; restore those settings or use a new output_dir"
                )
        else:
            suites = self.recipe.eval.suites
            per_suite = -(-self.cfg.general_records // len(suites))
            conversations: list[Conversation] = []
            for name in suites:
                where = self.recipe.resolve_path(name, "eval.suites")
                suite = load_suite(where, self.recipe, self.target, per_suite)
                conversations += answered(suite, self.target, self.recipe)
            records = [{"id": c.id, "messages": list(c.messages)} for c in conversations[: self.cfg.general_records]]
            stored = {**frozen, "conversations": records}
            self.root.mkdir(parents=True, exist_ok=True)
            atomic_write_json(path, stored)
        return self._samples([Conversation(r["id"], tuple(r["messages"]), "general") for r in stored["conversations"]])

    def _save_version(self, version: int, draft: nn.Module) -> Path:
        """versions/vNNNN/{checkpoint, <export.format>}, then `current` re-pointed atomically."""
        from speculators_train.export.run import export

        directory = version_dir(self.root, version)
        shutil.rmtree(directory, ignore_errors=True)  # a half-written one from a killed run
        checkpoint = ckpt.save_checkpoint(directory / ".staging", 0, draft, None, {"step": 0}, keep_last=1)
        final = version_checkpoint(directory)
        os.replace(checkpoint, final)
        shutil.rmtree(directory / ".staging", ignore_errors=True)
        fmt = self.recipe.export.format
        export(self.recipe, final, fmt, directory / fmt, force=True)
        self._point_current(version)
        return directory

    def _drop_uncommitted(self) -> None:
        """Remove what a killed run wrote past the commit point: versions beyond the committed one, `current` links
        never renamed into place, and history lines past the committed count (a half-written last one included)."""
        for version, directory in versions(self.root).items():
            if version > self.progress["version"]:
                shutil.rmtree(directory)
        for link in self.root.glob(".current-*"):
            link.unlink()
        history = self.root / OSD_HISTORY
        lines = history.read_bytes().split(b"\n") if history.is_file() else [b""]
        # A progress.json written before history lines were counted committed every complete line.
        kept = lines[: self.progress.setdefault("history_lines", len(lines) - 1)]
        if len(kept) < len(lines) - 1 or lines[-1]:
            atomic_write_bytes(history, b"".join(line + b"\n" for line in kept))

    def _point_current(self, version: int) -> None:
        """Re-point `current` atomically (a symlink renamed over the old one)."""
        link = self.root / f".current-{os.getpid()}"
        link.unlink(missing_ok=True)
        link.symlink_to(version_dir(self.root, version).relative_to(self.root))
        os.replace(link, current_version(self.root))

    def run(self) -> list[dict[str, Any]]:
        """Ingest what is new; score and buffer each full window of `update_interval` records and distil after it.
        A partial window waits for more traffic (it is read again next time, never counted twice)."""
        self.last_ingest = self.ingestor.run()
        entries = [e for e in self.ingestor.entries() if "messages" in e][self.progress["consumed"] :]
        size = self.cfg.update_interval
        windows = range(0, len(entries) - size + 1, size)
        if not windows:
            return []
        tracker = init_wandb(self.recipe, self.root, "-osd", f"{self.recipe.name}-osd")  # resumed across runs
        history = []
        for start in windows:
            history.append(self._window(entries[start : start + size]))
            if tracker is not None:
                numbers = {k: v for k, v in history[-1].items() if isinstance(v, int | float)}
                tracker.log(numbers, step=history[-1]["records_seen"])
        if tracker is not None:
            tracker.finish()
        plot(self.root / OSD_HISTORY, self.root / ACCEPTANCE_PLOT)
        return history

    def _take(self, entries: list[dict[str, Any]]) -> list[float]:
        """Held-out records join the log slice (up to its cap); the others are scored and offered to the buffer.
        Returns the training records' acceptance lengths."""
        conversations = [Conversation(e["id"], tuple(e["messages"]), e["origin"]) for e in entries]
        accepted = []
        for sample in self._samples(conversations):
            if is_held_out(sample["record"], self.cfg.held_out_fraction):
                if len(self.held_out) < self.cfg.held_out_records:
                    self.held_out.append(sample)
                continue
            scored = self.scorer.score(self.draft, sample["id"], sample)
            accepted.append(scored.acceptance)
            self.buffer.add(scored)
        return accepted

    def _window(self, entries: list[dict[str, Any]]) -> dict[str, Any]:
        """Score a window of traffic under the current version, distil, gate; then commit the progress."""
        accepted = self._take(entries)
        record: dict[str, Any] = {
            "records_seen": self.progress["records_seen"] + len(entries),
            "window_records": len(entries),
            "window_al": sum(accepted) / len(accepted) if accepted else None,
            "version": self.progress["version"],
        }
        if self.buffer.items and self.held_out:
            record.update(self._update())
            # Saved before the commit point, keeping the previous one: a kill in between resumes the trainee of the
            # last committed update, and the window is redone.
            updates = self.progress["updates"]
            ckpt.save_checkpoint(
                trainee_dir(self.root), updates, self.trainee, self.optimizer.state_dict(), {"update": updates}, 2
            )
            self.progress["trainee"] = updates
        self.progress["consumed"] += len(entries)
        self.progress["records_seen"] = record["records_seen"]
        self.progress["buffer"] = [
            {"id": item.id, "record": item.sample["record"], "acceptance": item.acceptance, "rejected": item.rejected}
            for item in self.buffer.items
        ]
        # before the commit: a restart drops it unless committed
        append_line(self.root / OSD_HISTORY, to_json(record) + "\n", sync=True)
        self.progress["history_lines"] += 1
        atomic_write_json(self.root / OSD_PROGRESS, self.progress)
        return record

    def _update(self) -> dict[str, Any]:
        """Train the trainee on the buffer, offer it to the gate; promote a copy of it or count the refusal."""
        cfg, candidate = self.cfg, self.trainee
        for group in self.optimizer.param_groups:  # the recipe's rate, also after a resume from a saved optimizer
            group["lr"] = cfg.learning_rate
        # The recipe's objective for this family, distilling with osd.divergence; the trainer's training step.
        objective = self.family.objective(candidate, self.head, self.recipe.draft, divergence=cfg.divergence)
        objective.train()
        # Seeded by the update's number: a rerun after a stop draws the batches an uninterrupted run draws.
        rng = random.Random(f"{self.recipe.seed}:{self.progress['updates']}")
        for _ in range(cfg.steps_per_update):
            batch = on_device(collate(self.buffer.batch(cfg.batch_size, rng)), self.head)
            train_step(self.accelerator, objective, self.optimizer, batch, self.recipe.training.max_grad_norm)
        candidate.eval()
        acceptance = self.scorer.acceptance
        old = (acceptance(self.draft, self.held_out), self._general(self.draft))
        new = (acceptance(candidate, self.held_out), self._general(candidate))
        baseline = (old[0], self.progress["general_baseline"])
        promote, why = gate(new, baseline, cfg.general_margin, cfg.min_gain)
        self.progress["updates"] += 1
        refusals = 0 if promote else self.progress.get("refusals", 0) + 1
        restarted = refusals >= cfg.restart_after_refusals
        if promote:
            self.progress["version"] += 1
            self.draft = copy.deepcopy(candidate)
            self._save_version(self.progress["version"], self.draft)
        elif restarted:
            self.trainee, self.optimizer = self._restart_trainee()
            refusals = 0
        self.progress["refusals"] = refusals
        log.info("update %d: %s (%s)", self.progress["updates"], "promoted" if promote else "kept", why)
        return {
            "log_al": old[0],
            "general_al": old[1],
            "candidate_log_al": new[0],
            "candidate_general_al": new[1],
            "promoted": promote,
            "reason": why,
            "trainee_restarted": restarted,
            "version_after": self.progress["version"],
        }

    def _general(self, draft: nn.Module) -> float:
        return self.scorer.acceptance(draft, self.general)
