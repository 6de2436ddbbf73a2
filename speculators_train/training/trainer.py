"""The training loop, shared by every draft family: forward/loss, backward, clip, step. No per-family branches:
the recipe's family builds the draft and its objective, and the loop only sees `objective(batch) -> (loss, sums)`.

Runs single-process (CPU or GPU), DDP across processes (`accelerate launch`, `torchrun`), or DeepSpeed ZeRO or
FSDP2 from the recipe. Offline data comes from generator shards; online data is captured from the target in the loop.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from typing import Any

import torch
from tqdm import tqdm

from speculators_train import families
from speculators_train.architectures import text_config
from speculators_train.errors import UserError
from speculators_train.families.base import Family
from speculators_train.families.drafts import check_fits, latest_checkpoint, load_draft, load_weights, read_pointer
from speculators_train.families.objective import Objective, Sums, predicted_al_key, summarize
from speculators_train.files import append_line, atomic_write_bytes, atomic_write_json, to_json
from speculators_train.loading import load_torch_state, reading
from speculators_train.recipe import Recipe
from speculators_train.runinfo import write_run_info
from speculators_train.target import TargetHead, load_head_weights, load_target
from speculators_train.tracking import init_wandb
from speculators_train.training import checkpoint as ckpt
from speculators_train.training import fsdp, zero
from speculators_train.training.data import collate
from speculators_train.training.select import select
from speculators_train.training.sources import OfflineSource, OnlineSource
from speculators_train.training.step import accelerator, optimizer, train_step, trainable

log = logging.getLogger(__name__)


def initial_draft(
    recipe: Recipe, family: Family, target_config, weights: dict[str, torch.Tensor], freq, aux_layer_ids: list[int]
):
    """A fresh draft of the recipe's family, or the draft named by `training.init_from` (in any format the family
    reads) to fine-tune, with its own vocab and settings."""
    if not recipe.training.init_from:
        return family.new_draft(recipe.draft, target_config, weights, freq, aux_layer_ids)
    path = recipe.resolve_path(recipe.training.init_from, "training.init_from", directory=True)
    text = text_config(target_config)
    loaded = load_draft(path, text.num_hidden_layers)
    if loaded.family is not family:
        raise UserError(
            f"{loaded.path}: a {loaded.family.name} draft, but the recipe trains draft.family {family.name}; "
            f"set draft.family: {loaded.family.name} to fine-tune it"
        )
    check_fits(loaded, text.hidden_size, text.vocab_size, text.num_hidden_layers)
    reads = list(family.states(loaded.draft.config).aux_layer_ids)
    if reads and reads != list(aux_layer_ids):
        raise UserError(
            f"{loaded.path}: this draft reads target layers {reads}, but the hidden states hold "
            f"{list(aux_layer_ids)}; set target.aux_layer_ids: {reads} and generate again"
        )
    # The target's embedding (frozen), as serving engines use it, even where the files carried one.
    family.attach_target(loaded.draft, weights["embed"], False)
    log.info("fine-tuning %s (from its own files and vocabulary)", loaded.path)
    return loaded.draft


def resume_identity(recipe: Recipe, data_fingerprint: str, world: int) -> dict[str, Any]:
    """Settings a resumed run must share with the interrupted one (budgets like epochs may change)."""
    t = recipe.training
    identity = {
        "seed": recipe.seed,
        "draft": recipe.draft.model_dump(),
        "learning_rate": t.learning_rate,
        "batch_size": t.batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "weight_decay": t.weight_decay,
        "length_bucketing": t.length_bucketing,
        "world_size": world,
        "deepspeed": t.deepspeed.model_dump() if t.deepspeed else None,
        "fsdp": t.fsdp.model_dump() if t.fsdp else None,
        "hidden_states": recipe.generation.hidden_states,
        "samples_per_shard": recipe.generation.samples_per_shard,
        "data": recipe.data.model_dump(exclude={"mix"}),
        "data_fingerprint": data_fingerprint,
    }
    if t.init_from:
        identity["init_from"] = t.init_from
    if t.select:
        identity["select"] = t.select.model_dump()
    return identity


def _with_defaults(identity: dict[str, Any], recipe: Recipe) -> dict[str, Any]:
    """A stored identity with settings added since it was written read as their defaults, so a new option never
    stops an old run from resuming."""
    identity = dict(identity)
    try:
        if isinstance(identity.get("draft"), dict):
            identity["draft"] = type(recipe.draft).model_validate(identity["draft"]).model_dump()
        if isinstance(identity.get("data"), dict):
            data = type(recipe.data).model_validate({**identity["data"], "mix": recipe.data.mix})
            identity["data"] = data.model_dump(exclude={"mix"})
    except ValueError:  # not a valid section at all: compared as stored, and named as a difference
        pass
    return identity


class Trainer:
    def __init__(self, recipe: Recipe, acc: Any = None) -> None:
        """`acc`: the run's accelerator when the caller made it first (`step.accelerator(recipe)`: the process
        group, which the run lock asks for its rank), else made here."""
        self.recipe = recipe
        self.cfg = recipe.training
        # In this order: the seeds are set before the source orders the data and before the head and the draft draw
        # their starting weights, so a seed keeps giving the same run.
        self._set_up_accelerator(acc)
        target_config, weights = self._set_up_data()
        self._set_up_state()
        objective = self._set_up_draft(target_config, weights)
        self._set_up_optimizer(objective)
        self._set_up_resume()

    def _set_up_accelerator(self, acc: Any = None) -> None:
        """The accelerator (devices, ranks, precision), the recipe's family, and the seeded generators."""
        self.accelerator = acc if acc is not None else accelerator(self.recipe)
        self.family = families.get(self.recipe.draft.family)
        torch.manual_seed(self.recipe.seed)
        random.seed(self.recipe.seed)

    def _set_up_data(self) -> tuple[Any, dict[str, torch.Tensor]]:
        """The data source (stored shards, or the target captured in the loop), and the target's config and head
        weights the draft starts from; refuses a run with nothing held out on any rank."""
        recipe = self.recipe
        world, rank = self.accelerator.num_processes, self.accelerator.process_index
        if recipe.generation.hidden_states == "offline":
            self.source = OfflineSource(recipe, world, rank)
        else:
            self.source = OnlineSource(recipe, load_target(recipe.target), world, rank, self._min_across_ranks)
        target_config, weights = load_head_weights(recipe.target)
        held_out = int(
            self.accelerator.reduce(torch.tensor(len(self.source.held_out), device=self.accelerator.device), "sum")
        )
        if held_out == 0:
            raise UserError(
                f"{recipe.source_path}: the held-out split has no samples, so nothing can be validated "
                "or kept as best; raise data.held_out_fraction"
            )
        if self._zero3 and self._min_across_ranks(len(self.source.held_out)) == 0:
            # Each ZeRO-3 forward gathers weights from every rank, so every rank validates on batches of its own.
            raise UserError(
                f"{recipe.source_path}: training.deepspeed.zero_stage 3 needs a held-out sample on each of the "
                f"{world} ranks, and the held-out split has {held_out}; raise data.held_out_fraction"
            )
        return target_config, weights

    def _set_up_state(self) -> None:
        """The state a checkpoint carries, fresh, with the settings a resumed run must share (`identity`)."""
        self.identity = resume_identity(self.recipe, self.source.data_fingerprint, self.accelerator.num_processes)
        self.state = {
            "step": 0,
            "epoch": 0,
            "position": None,
            "tokens": 0,
            "train_seconds": 0.0,
            "best": None,
            "identity": self.identity,
        }

    def _set_up_draft(self, target_config: Any, weights: dict[str, torch.Tensor]) -> Objective:
        """The draft (fresh or `init_from`) with the frozen target head as one objective, the samples it trains on
        (`training.select`), and what validation predicts with it."""
        recipe = self.recipe
        # The head is built first: its lm_head's initialisation draws from the seeded generator before the draft's
        # (then overwritten), so a seed keeps giving the same draft.
        head = TargetHead.from_weights(target_config, weights)
        draft = initial_draft(
            recipe, self.family, target_config, weights, self.source.token_freq, self.source.aux_layer_ids
        )
        draft.gradient_checkpointing = self.cfg.gradient_checkpointing
        objective = self.family.objective(draft, head, recipe.draft)
        if self.cfg.select is not None:
            # Scored with the draft as it starts (every rank alike), so a resumed run selects the same samples.
            started = time.perf_counter()
            objective.to(self.accelerator.device)
            kept = select(self.cfg.select, objective, self.source.train, recipe.seed, self.accelerator.device)
            self.source.restrict(kept)
            self.state["select_seconds"] = time.perf_counter() - started
            log.info("training.select: %d of %d samples (%s)", len(kept), len(self.source.train), self.cfg.select.by)
        self.steps, self.metric_keys = objective.steps, objective.metric_keys
        # The acceptance length held-out validation predicts, and the best checkpoint is kept by.
        self.al_depth = min(recipe.eval.num_speculative_tokens, self.steps)
        self.al_key = predicted_al_key(self.al_depth)
        return objective

    def _set_up_optimizer(self, objective: Objective) -> None:
        """The optimizer over the draft's trainable weights, the learning-rate schedule over the step (or time)
        budget, and both prepared by the accelerator."""
        opt = optimizer(trainable(objective.draft), self.cfg.learning_rate, self.cfg.weight_decay)
        self.batches_per_epoch = self.source.batches_per_epoch()
        steps_per_epoch = math.ceil(self.batches_per_epoch / self.cfg.gradient_accumulation_steps)
        total = self.cfg.epochs * steps_per_epoch
        self.total_steps = min(total, self.cfg.max_steps) if self.cfg.max_steps else total
        from torch.optim.lr_scheduler import LambdaLR
        from transformers import get_cosine_schedule_with_warmup

        if self.cfg.max_minutes:  # warmup and cosine over the time budget; the step count is unknown ahead
            self.scheduler = LambdaLR(opt, lambda _step: self._time_lr_factor())
        else:
            self.scheduler = get_cosine_schedule_with_warmup(
                opt, round(self.cfg.warmup_ratio * self.total_steps), self.total_steps
            )
        self.model, self.optimizer = self.accelerator.prepare(objective, opt)

    def _set_up_resume(self) -> None:
        """Where the run saves, and the state of its latest checkpoint when there is one."""
        self.run_dir = self.recipe.run_dir / "train"
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.wandb = None
        self._saved: str | None = None  # the `_position()` of the last checkpoint written or resumed from
        self._state_measured = False
        self._resume()

    def _time_lr_factor(self) -> float:
        """Linear warmup over `warmup_ratio` of the time budget, then cosine to 0 at its end."""
        progress = min(1.0, self.state["train_seconds"] / (60 * self.cfg.max_minutes))
        warmup = self.cfg.warmup_ratio
        if progress < warmup:
            return progress / warmup
        return 0.5 * (1 + math.cos(math.pi * (progress - warmup) / (1 - warmup)))

    def _out_of_time(self) -> bool:
        return bool(self.cfg.max_minutes) and self.state["train_seconds"] >= 60 * self.cfg.max_minutes

    def _max_across_ranks(self, value: float) -> float:
        """The largest `value` of any rank (ranks' clocks differ: the time budget must stop them all at the same
        step)."""
        if self.accelerator.num_processes == 1:
            return value
        import torch.distributed as dist

        tensor = torch.tensor(value, device=self.accelerator.device, dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return float(tensor)

    def _min_across_ranks(self, value: int) -> int:
        if self.accelerator.num_processes == 1:
            return value
        import torch.distributed as dist

        tensor = torch.tensor(value, device=self.accelerator.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
        return int(tensor)

    @property
    def draft(self) -> torch.nn.Module:
        objective: Objective = self.accelerator.unwrap_model(self.model)
        return objective.draft

    @property
    def _zero3(self) -> bool:
        return self.cfg.deepspeed is not None and self.cfg.deepspeed.zero_stage == 3

    def _resume(self) -> None:
        path = latest_checkpoint(self.ckpt_dir)
        if path is None:
            return
        optimizer_state, state = ckpt.load_training_state(path)
        stored = _with_defaults(state.get("identity", {}), self.recipe)
        diffs = {k: (stored.get(k), v) for k, v in self.identity.items() if stored.get(k) != v}
        if diffs:
            detail = "; ".join(f"{k}: {a!r} there, {b!r} now" for k, (a, b) in diffs.items())
            raise UserError(f"{path} was trained with other settings ({detail}); use another output_dir")
        if optimizer_state is None:
            raise UserError(
                f"{path} holds no optimizer state, so it cannot continue exactly; start a new output_dir, "
                "or delete its checkpoints to retrain"
            )
        weights = load_weights(path)
        with reading(path, "checkpoint does not fit this run"):  # a damaged or foreign state: one line, no trace
            if self.cfg.fsdp is not None:
                fsdp.load_full_weights(self.draft, weights)
            elif self._zero3:
                with zero.whole(self.draft, modify=True):
                    self.draft.load_state_dict(weights, strict=False)
            else:
                self.draft.load_state_dict(weights, strict=False)
            if self.cfg.deepspeed is not None:
                zero.restore(self.model.optimizer, self._trainable(), optimizer_state["zero"])
            elif self.cfg.fsdp is not None:
                shard = path / fsdp.shard_name(self.accelerator.process_index, self.accelerator.num_processes)
                saved = load_torch_state(shard, "optimizer shard")
                fsdp.restore_optimizer_state(self.optimizer.optimizer, self._trainable(), saved)
            else:
                self.optimizer.load_state_dict(optimizer_state["optimizer"])
            self.scheduler.load_state_dict(optimizer_state["scheduler"])
            # The scheduler's state does not carry the learning rate it last set (the optimizer's state does, and
            # the ZeRO state above does not), so set it from the scheduler.
            for group, lr in zip(self.scheduler.optimizer.param_groups, self.scheduler.get_last_lr(), strict=True):
                group["lr"] = lr
            torch.set_rng_state(optimizer_state["torch_rng"])
        self.state = state
        self._saved = self._position()
        # A kill between a checkpoint and its best.json leaves the pointer behind the state that names the best.
        best = state["best"]
        if self.accelerator.is_main_process and best is not None and read_pointer(self.ckpt_dir / "best.json") != best:
            atomic_write_json(self.ckpt_dir / "best.json", best)
        log.info(
            "resuming from %s (step %d, epoch %d, position %s)", path, state["step"], state["epoch"], state["position"]
        )

    def _save(self) -> None:
        self.accelerator.wait_for_everyone()
        optimizer_state = {"scheduler": self.scheduler.state_dict(), "torch_rng": torch.get_rng_state()}
        weights = shards = None
        if self.cfg.deepspeed is not None:
            optimizer_state["zero"] = zero.gather(self.model.optimizer, self._trainable())  # every rank takes part
            if self._zero3:
                weights = zero.full_weights(self.draft)
        elif self.cfg.fsdp is not None:
            weights = fsdp.full_weights(self.draft)  # every rank takes part; rank 0 writes them
            shards = self._stage_optimizer_shards()
        else:
            optimizer_state["optimizer"] = self.optimizer.state_dict()
        self._saved = self._position()
        if self.accelerator.is_main_process:
            ckpt.save_checkpoint(
                self.ckpt_dir,
                self.state["step"],
                self.draft,
                optimizer_state,
                self.state,
                self.cfg.keep_last,
                weights=weights,
                shards=shards,
            )
            if self.state["best"] is not None and self.state["best"]["step"] == self.state["step"]:
                atomic_write_json(self.ckpt_dir / "best.json", self.state["best"])
        self.accelerator.wait_for_everyone()

    def _stage_optimizer_shards(self):
        """Each rank's slice of the Adam moments into one staging directory, all written before rank 0 moves them
        into the checkpoint."""
        acc = self.accelerator
        if acc.is_main_process:
            ckpt.stage_shards(self.ckpt_dir, self.state["step"])
        acc.wait_for_everyone()
        staging = self.ckpt_dir / f".shards-{self.state['step']:06d}"
        local = fsdp.local_optimizer_state(self.optimizer.optimizer, self._trainable())
        torch.save(local, staging / fsdp.shard_name(acc.process_index, acc.num_processes))
        acc.wait_for_everyone()
        return staging

    def _state_mib(self) -> dict[str, float]:
        """Rank 0's share of the training state after a step, in MiB: the objective's weights (trainable and frozen;
        a shard of each under FSDP2) and what the optimizer keeps (Adam moments, and ZeRO's fp32 master slices)."""
        from torch.distributed.tensor import DTensor

        def size(t: torch.Tensor) -> int:
            t = t.to_local() if isinstance(t, DTensor) else getattr(t, "ds_tensor", t)  # ZeRO-3: the rank's partition
            return t.numel() * t.element_size()

        inner = self.model.optimizer.optimizer if self.cfg.deepspeed is not None else self.optimizer.optimizer
        held = [t for state in inner.state.values() for t in state.values() if torch.is_tensor(t) and t.dim() > 0]
        if self.cfg.deepspeed is not None:
            held += [p for group in inner.param_groups for p in group["params"]]  # the fp32 master partitions
        return {
            "memory/weights_mib": sum(size(p) for p in self.model.parameters()) / 2**20,
            "memory/optimizer_mib": sum(size(t) for t in held) / 2**20,
        }

    def _trainable(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(name, p) for name, p in self.draft.named_parameters() if p.requires_grad]

    def _trim_log(self) -> None:
        """Drop the metrics.jsonl lines the checkpoint this run continues from does not cover (and a line cut by a
        kill), so a resumed run's log has each step and each validation once: what a killed run logged after its
        last checkpoint is redone and logged again. Training lines are covered up to the checkpoint's step,
        validation lines up to the step it last validated."""
        path = self.run_dir / "metrics.jsonl"
        if not self.accelerator.is_main_process or not path.is_file():
            return
        covered = {"train": self.state["step"], "val": self.state.get("held_out_step", self.state["step"])}
        kept = []
        for line in path.read_text(errors="replace").splitlines(keepends=True):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not line.endswith("\n") or not isinstance(record, dict):
                continue
            kind = "val" if any(key.startswith("val/") for key in record) else "train"
            if record.get("step", 0) <= (covered[kind] or 0):
                kept.append(line)
        atomic_write_bytes(path, "".join(kept).encode())

    def _log(self, record: dict[str, Any]) -> None:
        if self.accelerator.is_main_process:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            append_line(self.run_dir / "metrics.jsonl", to_json(record) + "\n")
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
        self.model.eval()
        held_out = self.source.held_out  # this rank's share
        zero = torch.zeros(2, device=self.accelerator.device)
        sums = dict.fromkeys(self.metric_keys, zero)
        reshard = self.cfg.fsdp.reshard_after_forward if self.cfg.fsdp is not None else True
        starts = list(range(0, len(held_out), self.cfg.batch_size))
        counted = len(starts)
        if self._zero3:
            # A ZeRO-3 forward is a collective: a rank with fewer batches repeats its last one, and drops its metrics.
            starts += [starts[-1]] * (int(self._max_across_ranks(counted)) - counted)
        with fsdp.gathered(self.model, reshard):
            for n, k in enumerate(starts):
                batch = collate([held_out[i] for i in range(k, min(k + self.cfg.batch_size, len(held_out)))])
                _, metrics = self.model(self._to_device(batch))
                if n >= counted:
                    continue
                for key, value in metrics.items():
                    sums[key] = sums[key] + value
        self.model.train()
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
        cfg, state = self.cfg, self.state
        self.wandb = self._init_wandb()
        if self.accelerator.is_main_process:
            write_run_info(self.run_dir, self.recipe.model_dump(mode="json"))
        self._trim_log()
        bar = tqdm(
            total=self.total_steps,
            initial=state["step"],
            unit="step",
            disable=not self.accelerator.is_main_process,
            desc="train",
        )
        sums: Sums = {}
        losses: list[torch.Tensor] = []
        tokens, started = 0, time.perf_counter()
        self.model.train()
        while state["step"] < self.total_steps and state["epoch"] < cfg.epochs and not self._out_of_time():
            finished_epoch = True
            for batch, position in self.source.epoch(state["epoch"], state["position"]):
                # 1) forward + loss, backward; clip and step once per accumulated group
                loss, step_metrics = train_step(
                    self.accelerator, self.model, self.optimizer, self._to_device(batch), cfg.max_grad_norm
                )
                losses.append(loss)
                for key, value in step_metrics.items():
                    sums[key] = sums.get(key, 0) + value
                tokens += int(batch["lengths"].sum())
                state["position"] = position
                if not self.accelerator.sync_gradients:
                    continue
                # 2) bookkeeping of one optimizer step
                seconds = time.perf_counter() - started
                state["train_seconds"] = state.get("train_seconds", 0.0) + (
                    self._max_across_ranks(seconds) if cfg.max_minutes else seconds
                )
                self.scheduler.step()
                state["step"] += 1
                state["tokens"] += tokens * self.accelerator.num_processes
                rate = tokens * self.accelerator.num_processes / seconds
                record = {
                    "step": state["step"],
                    "epoch": state["epoch"],
                    "lr": self.scheduler.get_last_lr()[0],
                    "loss": self.accelerator.reduce(torch.stack(losses).mean(), reduction="mean").item(),
                    "tokens_per_s": rate,
                }
                self._refuse_non_finite("training loss", record["loss"])
                if not self._state_measured:  # once a process: what the strategy leaves on each rank
                    record.update(self._state_mib())
                    self._state_measured = True
                if state["step"] % cfg.log_every_steps == 0 or state["step"] == self.total_steps:
                    summary = summarize(self._sum(sums), self.steps)
                    record.update({f"train/{k}": v for k, v in summary.items() if "acc" in k or k == "vocab_coverage"})
                    sums = {}
                self._log(record)
                bar.update(1)
                bar.set_postfix(tok_s=f"{rate:.0f}", loss=f"{record['loss']:.3f}")
                if cfg.eval_every_steps and state["step"] % cfg.eval_every_steps == 0:
                    self._evaluate()
                due = cfg.save_every_steps and state["step"] % cfg.save_every_steps == 0
                if due and self._saved != self._position():
                    self._save()
                if state["step"] >= self.total_steps or self._out_of_time():
                    finished_epoch = False
                    break
                losses, tokens, started = [], 0, time.perf_counter()  # validation and saves are not training time
            # 3) end of the epoch or of the budget: validate, checkpoint, keep the best
            if finished_epoch:
                state["epoch"] += 1
                state["position"] = None
            self._finish_step()
            started = time.perf_counter()
        # 4) a run killed after its last checkpoint, before that step's validation, resumes with nothing to train
        self._finish_step()
        bar.close()
        if self.wandb is not None:
            self.wandb.finish()
        return state["held_out"]

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
