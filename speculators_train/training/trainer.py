"""The training loop, shared by every draft family: forward/loss, backward, clip, step. No per-family branches:
the recipe's family builds the draft and its objective, and the loop only sees `objective(batch) -> (loss, sums)`.

Runs single-process (CPU or GPU), DDP across processes (`accelerate launch`, `torchrun`), or DeepSpeed ZeRO or
FSDP2 from the recipe, each behind one `training.strategies.Strategy`. Offline data comes from generator shards;
online data is captured from the target in the loop.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from tqdm import tqdm

from speculators_train import families
from speculators_train.distributed import across_ranks
from speculators_train.errors import UserError
from speculators_train.families.base import DraftStart
from speculators_train.families.objective import Objective, Sums, predicted_al_key, summarize
from speculators_train.files import append_line, atomic_write_json, to_json
from speculators_train.head import TargetHead, load_head_weights, target_folder
from speculators_train.layout import (
    BEST,
    METRICS,
    RUN_INFO,
    checkpoints_dir,
    latest_checkpoint,
    read_pointer,
    train_dir,
)
from speculators_train.recipe import Recipe
from speculators_train.runinfo import write_run_info
from speculators_train.target import load_target
from speculators_train.tracking import init_wandb
from speculators_train.training import checkpoint as ckpt
from speculators_train.training.batches import CapturedBatches, StoredBatches
from speculators_train.training.data import collate
from speculators_train.training.schedule import lr_scheduler, out_of_time, total_steps
from speculators_train.training.select import select
from speculators_train.training.start import initial_draft, resume, resume_identity, trim_log
from speculators_train.training.step import optimizer, train_step, trainable
from speculators_train.training.strategies import Strategy, accelerator, for_recipe

log = logging.getLogger(__name__)


@dataclass
class _Window:
    """What the micro-batches since the last optimizer step (the metric sums: since the last log line) add up to."""

    losses: list[torch.Tensor] = field(default_factory=list)
    tokens: int = 0
    sums: Sums = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)

    def add(self, loss: torch.Tensor, metrics: Sums, tokens: int) -> None:
        self.losses.append(loss)
        for key, value in metrics.items():
            self.sums[key] = self.sums.get(key, 0) + value
        self.tokens += tokens


class Trainer:
    def __init__(self, recipe: Recipe, strategy: Strategy | None = None) -> None:
        """`strategy`: the run's, with its accelerator, when the caller made them first (`accelerator(recipe,
        strategy)`: the process group, which the run lock asks for its rank), else made here."""
        self.recipe = recipe
        self.cfg = recipe.training
        # In this order: the seeds are set before the source orders the data and before the head and the draft draw
        # their starting weights, so a seed keeps giving the same run.
        self._set_up_accelerator(strategy)
        start = self._set_up_data()
        self._set_up_state()
        objective = self._set_up_draft(start)
        self._set_up_optimizer(objective)
        self._set_up_resume()

    def _set_up_accelerator(self, strategy: Strategy | None) -> None:
        """The strategy and its accelerator (devices, ranks, precision), the recipe's family, and the seeded
        generators."""
        self.strategy = strategy if strategy is not None else for_recipe(self.recipe)
        if self.strategy.acc is None:
            accelerator(self.recipe, self.strategy)
        self.accelerator = self.strategy.acc
        self.family = families.get(self.recipe.draft.family)
        torch.manual_seed(self.recipe.seed)
        random.seed(self.recipe.seed)

    def _set_up_data(self) -> DraftStart:
        """The batch stream (stored shards, or the target captured in the loop), and what a fresh draft starts from
        (the target's config, folder and head weights, the data's token counts); refuses a run with nothing held out
        on any rank."""
        recipe = self.recipe
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        if recipe.generation.hidden_states == "offline":
            self.batches = StoredBatches(recipe, world, rank)
        else:
            fewest = partial(across_ranks, self.accelerator, op="min")
            self.batches = CapturedBatches(recipe, load_target(recipe.target), world, rank, fewest)
        folder = target_folder(recipe.target)
        target_config, weights = load_head_weights(recipe.target, folder)
        mine = len(self.batches.held_out)
        held_out = int(self.accelerator.reduce(torch.tensor(mine, device=self.accelerator.device), "sum"))
        self.strategy.check_held_out(held_out, lambda: across_ranks(self.accelerator, mine, "min"))
        return DraftStart(target_config, folder, weights, self.batches.token_freq, self.batches.aux_layer_ids)

    def _set_up_state(self) -> None:
        """The state a checkpoint carries, fresh, with the settings a resumed run must share (`identity`)."""
        self.identity = resume_identity(self.recipe, self.batches.data_fingerprint, self.accelerator.num_processes)
        self.state = {
            "step": 0,
            "epoch": 0,
            "position": None,
            "tokens": 0,
            "train_seconds": 0.0,
            "best": None,
            "identity": self.identity,
        }

    def _set_up_draft(self, start: DraftStart) -> Objective:
        """The draft (fresh or `init_from`) with the frozen target head as one objective, the samples it trains on
        (`training.select`), and what validation predicts with it."""
        recipe = self.recipe
        # The head is built first: its lm_head's initialisation draws from the seeded generator before the draft's
        # (then overwritten), so a seed keeps giving the same draft.
        head = TargetHead.from_weights(start.target_config, start.head)
        draft = initial_draft(recipe, self.family, start)
        draft.gradient_checkpointing = self.cfg.gradient_checkpointing
        objective = self.family.objective(draft, head, recipe.draft)
        if self.cfg.select is not None:
            # Scored with the draft as it starts (every rank alike), so a resumed run selects the same samples.
            started = time.perf_counter()
            objective.to(self.accelerator.device)
            kept = select(self.cfg.select, objective, self.batches.train, recipe.seed, self.accelerator.device)
            self.batches.restrict(kept)
            self.state["select_seconds"] = time.perf_counter() - started
            log.info("training.select: %d of %d samples (%s)", len(kept), len(self.batches.train), self.cfg.select.by)
        self.chain_length, self.metric_keys, self.columns = objective.steps, objective.metric_keys, objective.columns
        # The acceptance length held-out validation predicts, and the best checkpoint is kept by.
        self.al_depth = min(recipe.eval.num_speculative_tokens, self.chain_length)
        self.al_key = predicted_al_key(self.al_depth)
        return objective

    def _set_up_optimizer(self, objective: Objective) -> None:
        """The optimizer over the draft's trainable weights, the learning-rate schedule over the step (or time)
        budget, and both prepared by the accelerator."""
        opt = optimizer(trainable(objective.draft), self.cfg.learning_rate, self.cfg.weight_decay)
        self.batches_per_epoch = self.batches.batches_per_epoch()
        self.total_steps = total_steps(self.cfg, self.batches_per_epoch)
        # The state, not its value now: a resumed run replaces it.
        self.scheduler = lr_scheduler(opt, self.cfg, self.total_steps, lambda: self.state["train_seconds"])
        self.objective, self.optimizer = self.strategy.prepare(objective, opt)

    def _set_up_resume(self) -> None:
        """Where the run saves, and the state of its latest checkpoint when there is one."""
        self.run_dir = train_dir(self.recipe.run_dir)
        self.ckpt_dir = checkpoints_dir(self.recipe.run_dir)
        self.wandb = None
        self._saved: str | None = None  # the `_position()` of the last checkpoint written or resumed from
        self._state_measured = False
        self._resume()

    def _out_of_time(self) -> bool:
        return out_of_time(self.cfg, self.state["train_seconds"])

    @property
    def draft(self) -> torch.nn.Module:
        return self.strategy.draft

    def _resume(self) -> None:
        path = latest_checkpoint(self.ckpt_dir)
        if path is None:
            return
        self.state = state = resume(path, self.identity, self.recipe, self.strategy, self.scheduler)
        self._saved = self._position()
        # A kill between a checkpoint and its best.json leaves the pointer behind the state that names the best.
        best = state["best"]
        if self.accelerator.is_main_process and best is not None and read_pointer(self.ckpt_dir / BEST) != best:
            atomic_write_json(self.ckpt_dir / BEST, best)
        log.info(
            "resuming from %s (step %d, epoch %d, position %s)", path, state["step"], state["epoch"], state["position"]
        )

    def _save(self) -> None:
        self.accelerator.wait_for_everyone()
        saved = self.strategy.save(self.ckpt_dir, self.state["step"])  # every rank takes part
        optimizer_state = {
            **saved.optimizer,
            "scheduler": self.scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
        }
        self._saved = self._position()
        if self.accelerator.is_main_process:
            ckpt.save_checkpoint(
                self.ckpt_dir,
                self.state["step"],
                self.draft,
                optimizer_state,
                self.state,
                self.cfg.keep_last,
                weights=saved.weights,
                shards=saved.shards,
            )
            if self.state["best"] is not None and self.state["best"]["step"] == self.state["step"]:
                atomic_write_json(self.ckpt_dir / BEST, self.state["best"])
        self.accelerator.wait_for_everyone()

    def _log(self, record: dict[str, Any]) -> None:
        if self.accelerator.is_main_process:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            append_line(self.run_dir / METRICS, to_json(record) + "\n")
            if self.wandb is not None:
                self.wandb.log(record, step=record["step"])

    def _sum(self, sums: Sums) -> dict[str, list[float]]:
        """[numerator, denominator] per key, summed over ranks (every rank passes the same keys)."""
        keys = sorted(sums)
        stacked = self.accelerator.reduce(torch.stack([sums[k] for k in keys]), reduction="sum")
        return dict(zip(keys, stacked.tolist(), strict=True))

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Held-out metrics summed over this rank's samples, then over ranks (every rank reduces, even with none)."""
        self.objective.eval()
        held_out = self.batches.held_out  # this rank's share
        sums = dict.fromkeys(self.metric_keys, torch.zeros(2, device=self.accelerator.device))
        starts = list(range(0, len(held_out), self.cfg.batch_size))
        counted = len(starts)
        starts = self.strategy.validation_batches(starts, lambda n: across_ranks(self.accelerator, n, "max"))
        with self.strategy.whole_for_validation():
            for n, k in enumerate(starts):
                batch = collate([held_out[i] for i in range(k, min(k + self.cfg.batch_size, len(held_out)))])
                _, metrics = self.objective(self._to_device(batch))
                if n >= counted:  # a collective's padding
                    continue
                for key, value in metrics.items():
                    sums[key] = sums[key] + value
        self.objective.train()
        return summarize(self._sum(sums), self.al_depth)

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.accelerator.device, non_blocking=True) for k, v in batch.items()}

    def _evaluate(self) -> bool:
        """Validate on the held-out split; a better predicted acceptance length is checkpointed as the best.
        Returns whether this step was just saved."""
        metrics = self.validate()
        for key, value in metrics.items():
            self._refuse_non_finite(f"held-out {key}", value)
        # Saved with the checkpoint (a family may build its tree from them); the step says they are current.
        self.state["held_out"], self.state["held_out_step"] = metrics, self.state["step"]
        key = self.al_key
        self._log({"step": self.state["step"], **{f"val/{k}": v for k, v in metrics.items()}})
        best = self.state["best"]
        if best is None or metrics[key] > best["value"]:
            self.state["best"] = {"step": self.state["step"], "metric": key, "value": metrics[key]}
            self._save()
            return True
        return False

    def train(self) -> dict[str, float]:
        """Epochs of micro-batches; validate, keep the best and checkpoint at each epoch end and at the budget.
        Returns the held-out metrics of the last step (a rerun of a finished run returns them again)."""
        state = self.state
        self.wandb = self._init_wandb()
        if self.accelerator.is_main_process:
            write_run_info(self.run_dir / RUN_INFO, self.recipe.model_dump(mode="json"))
            trim_log(self.run_dir / METRICS, state)
        main = self.accelerator.is_main_process
        self._bar = tqdm(total=self.total_steps, initial=state["step"], unit="step", disable=not main, desc="train")
        self._window = _Window()
        self.objective.train()
        while state["step"] < self.total_steps and state["epoch"] < self.cfg.epochs and not self._out_of_time():
            if self._run_epoch():  # the epoch's data ran out, not the budget
                state["epoch"] += 1
                state["position"] = None
            # At the end of the epoch or of the budget: validate, checkpoint, keep the best.
            self._finish_step()
            self._window.started = time.perf_counter()
        # A run killed after its last checkpoint, before that step's validation, resumes with nothing to train.
        self._finish_step()
        self._bar.close()
        if self.wandb is not None:
            self.wandb.finish()
        return state["held_out"]

    def _run_epoch(self) -> bool:
        """The current epoch's micro-batches from its stored position: forward + loss, backward; clip and step once
        per accumulated group. False when the budget ends it first."""
        state, window = self.state, self._window
        for batch, position in self.batches.epoch(state["epoch"], state["position"]):
            loss, metrics = train_step(
                self.accelerator, self.objective, self.optimizer, self._to_device(batch), self.cfg.max_grad_norm
            )
            window.add(loss, metrics, int(batch["lengths"].sum()))
            state["position"] = position
            if not self.accelerator.sync_gradients:
                continue
            self._stepped()
            if state["step"] >= self.total_steps or self._out_of_time():
                return False
            self._window = window = _Window(sums=window.sums)  # validation and saves are not training time
        return True

    def _stepped(self) -> None:
        """The bookkeeping of one optimizer step: time and schedule, its log line, validation and a save when due."""
        cfg, state, window = self.cfg, self.state, self._window
        world = self.accelerator.num_processes
        seconds = time.perf_counter() - window.started
        state["train_seconds"] = state.get("train_seconds", 0.0) + (
            across_ranks(self.accelerator, seconds, "max") if cfg.max_minutes else seconds
        )
        self.scheduler.step()
        state["step"] += 1
        state["tokens"] += window.tokens * world
        record = {
            "step": state["step"],
            "epoch": state["epoch"],
            "lr": self.scheduler.get_last_lr()[0],
            "loss": self.accelerator.reduce(torch.stack(window.losses).mean(), reduction="mean").item(),
            "tokens_per_s": window.tokens * world / seconds,
        }
        self._refuse_non_finite("training loss", record["loss"])
        if not self._state_measured:  # once a process: what the strategy leaves on each rank
            record.update(self.strategy.memory_mib())
            self._state_measured = True
        if state["step"] % cfg.log_every_steps == 0 or state["step"] == self.total_steps:
            summary = summarize(self._sum(window.sums), self.chain_length)
            shown = ("vocab_", "confidence_")  # totals over the steps: coverage, a confidence head's fit
            record.update({f"train/{k}": v for k, v in summary.items() if "acc" in k or k.startswith(shown)})
            window.sums = {}
        self._log(record)
        self._bar.update(1)
        self._bar.set_postfix(tok_s=f"{record['tokens_per_s']:.0f}", loss=f"{record['loss']:.3f}")
        if cfg.eval_every_steps and state["step"] % cfg.eval_every_steps == 0:
            self._evaluate()
        due = cfg.save_every_steps and state["step"] % cfg.save_every_steps == 0
        if due and self._saved != self._position():
            self._save()

    def _finish_step(self) -> None:
        """Validate the current step unless it was, and checkpoint the state unless it is saved as it stands."""
        if self.state.get("held_out_step") != self.state["step"]:
            self._evaluate()
        if self._saved != self._position():
            self._save()

    def _refuse_non_finite(self, what: str, value: float) -> None:
        """Stop at the first NaN or inf (every rank sees the same reduced value, so all stop together): nothing
        after the last checkpoint is saved, logged as best or exported."""
        if math.isfinite(value):
            return
        last = latest_checkpoint(self.ckpt_dir) if self.ckpt_dir.is_dir() else None
        kept = f"the last good checkpoint is {last}" if last is not None else "no checkpoint was saved yet"
        raise UserError(
            f"step {self.state['step']}: the {what} is {value}: training stopped and saved nothing after it; {kept}. "
            "Lower training.learning_rate or training.max_grad_norm, or check the data, then rerun to resume"
        )

    def _position(self) -> str:
        """Where the run stands (step, data position, last validation): equal positions need no second save."""
        keys = ("step", "epoch", "position", "held_out_step")
        return json.dumps({k: self.state.get(k) for k in keys}, sort_keys=True)

    def _init_wandb(self):
        return init_wandb(self.recipe, self.run_dir) if self.accelerator.is_main_process else None
