"""One rank's training, torchtitan-style: ``run_rank`` orchestrates, ``train_epoch`` runs one
epoch's steps, the strategy's ``train_step`` does one optimizer step, ``evaluate``
(``training.validation``) one validation pass over every validation row. This module is the step
loop only; what it calls lives beside it: the loss and its distillation terms are the task's
(``training.tasks``), the optimizer and LR schedule ``training.optimizer``'s, the NaN guard
``training.non_finite``'s, the timer ``training.step_timer``'s, which checkpoint a launch resumes
from ``training.restore``'s. How the model is trained in parallel is the strategy's
(``training.strategies``); everything rank 0 writes is the recorder's (``training.recorder``);
data, precision and checkpoints live in their own modules. This loop is the only one: every
backend, strategy and launch (Horovod elastic included) runs it.

Every rank runs exactly ``plan.steps_per_epoch`` steps per epoch, and every collective
(gradient synchronisation, metric reduction, the non-finite check, checkpoint RNG gather) happens
at the same steps on every rank, so no rank can wait for one that has stopped. Evaluation is the
one place ranks may run different numbers of batches: it reduces its sums once, at the end.

Where a rank's run stands is one ``TrainState`` (step, finished epochs' records, this rank's
partial epoch loss); it produces the checkpoint and is rebuilt from one. A checkpoint is never
written from a non-finite loss or non-finite weights: producing it runs the non-finite check
first, on every rank.

How a run survives failures is its ``Attempts``: ``OneAttempt`` (a failure ends the ranks and
the driver relaunches them from the newest checkpoint), or Horovod elastic
(``training.elastic.HorovodElastic``: survivors roll back to the last epoch end and go on at the
new world size). Both drive the same ``_train``.

Rank-side only: runs inside a rank a launcher started (``training.launchers``), or in the driver
process for ``launch.mode=in_process``. Ranks read the typed ``TrainConfig`` (``plan.config``);
checkpoints and model.json keep it as plain data.
"""

from __future__ import annotations

import logging
import math
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from common.features import FeatureSpec
from common.tasks import label_task
from training.checkpoint import CheckpointManager
from training.data import RankLoader
from training.distributed import LocalGroup, set_threads, spark_gpu_addresses
from training.export import check_scriptable
from training.image_loading import ImageAugment
from training.model_specs import build_model
from training.non_finite import NonFiniteGuard
from training.optimizer import make_optimizer, set_lr
from training.plan import RankPlan
from training.recorder import Recorder
from training.restore import restore, rng_state, run_identity, saved_rank
from training.shuffle_buffers import BufferMemory
from training.split_layout import check_manifest_unchanged
from training.step_timer import StepTimer
from training.strategies import build_strategy
from training.tasks import Objective
from training.user_code import UserObjective, probe
from training.validation import evaluate

log = logging.getLogger("shardtrain.train")


class Hooks:
    """What a launcher watches a rank's progress with (``training.launchers.progress.Reporter`` has
    the same four methods): ``on_step(step)`` after every optimizer step (and its mid-epoch
    checkpoint, if due); ``on_validation(batches)`` during each validation pass (see ``evaluate``);
    ``should_stop(record)`` on rank 0 at each epoch end, with the epoch's record (validation
    included): True ends the run at this boundary (a sweep's pruner decides, on the driver);
    ``on_published()`` on rank 0 once the model is published, before the run report and tracking."""

    def __init__(self, on_step: Callable[[int], None] | None = None,
                 on_epoch: Callable[[dict], bool] | None = None):
        self._on_step = on_step
        self._on_epoch = on_epoch

    def on_step(self, step: int) -> None:
        if self._on_step:
            self._on_step(step)

    def should_stop(self, record: dict) -> bool:
        return bool(self._on_epoch(record)) if self._on_epoch else False

    def on_validation(self, batches: int | None) -> None:
        pass

    def on_published(self) -> None:
        pass


def run_rank(plan: RankPlan, group=None, hooks=None) -> dict:
    """Train on this rank; returns plain values (per-rank step counts, loader stats, metrics).
    ``group``: the rank group (``training.distributed``; None: one process on the CPU)."""
    group = group or LocalGroup()
    hooks = hooks or Hooks()
    _quiet_libraries()
    if group.rank == 0:
        log.info("training on %d rank(s); rank 0 uses %s (%s)", group.size, group.device, group.device_reason)
    set_threads(group.local_size)
    run = _build(plan, group)
    attempts = _attempts(plan, group)
    return attempts.run(run, lambda state: _train(run, state, hooks, attempts))


class OneAttempt:
    """A run whose ranks live and fail together: a failure ends them all, and the driver may
    relaunch them (``launch.max_restarts``), resuming from the newest checkpoint."""

    def run(self, run: "RankRun", body: Callable[["TrainState"], dict]) -> dict:
        state = run.start()
        run.strategy.broadcast_initial_state(run.model, run.optimizer)  # one starting point on every rank
        run.adopt(run.plan, state.step)
        return body(state)

    def commit(self, state: "TrainState") -> None:
        """An epoch ended (its checkpoint, if due, is written): nothing more to keep."""


def _attempts(plan: RankPlan, group):
    if plan.config.launch.elastic:
        from training.elastic import HorovodElastic

        return HorovodElastic(group)
    return OneAttempt()


def _train(run: "RankRun", state: "TrainState", hooks, attempts) -> dict:
    """The epochs left from ``state`` on, then (rank 0) publish, report and track."""
    plan, group, device = run.plan, run.group, run.device
    train_loader, val_loader = loaders(plan, run.strategy)
    for epoch in range(state.step // plan.steps_per_epoch, plan.config.train.epochs):
        check_manifest_unchanged(plan.dataset_uri, plan.fingerprint)  # the dataset planned on, still
        record = train_epoch(run, state, train_loader, epoch, hooks.on_step)
        if val_loader:
            record.update(evaluate(run, val_loader, hooks.on_validation))
        stop = _stop_asked(run, hooks, record)  # asked first: a run that stops here saves this checkpoint
        _end_epoch(run, state, epoch, record, stop)
        attempts.commit(state)
        if stop:
            if group.rank == 0:
                log.info("stopping after epoch %d of %d: the driver asked (a sweep's pruner)", epoch + 1,
                         plan.config.train.epochs)
            break

    restored = run.restored
    result = {"rank": group.rank, "device": str(device), "device_reason": group.device_reason,
              "gpu_addresses": spark_gpu_addresses(), "steps": state.step, "steps_per_epoch": plan.steps_per_epoch,
              "world_size": group.size, "epoch_stats": [stats.__dict__ for stats in train_loader.stats],
              "resumed_from": restored["uri"], "resumed_step": restored["step"],
              "checkpoint_problems": restored["problems"],
              "stopped_early": len(state.history) < plan.config.train.epochs}
    # FSDP: all ranks gather the weights; rank 0 gets a plain module to export.
    final = run.strategy.unsharded(run.model, lambda: build_model(plan.config.model, plan.feature_spec,
                                                                  plan.label_spec, plan.user_code).to(device))
    if group.rank == 0:
        result.update(run.recorder.publish(final, state.history, device))
        hooks.on_published()
        run.recorder.report_and_track(state.history)
    return result


@dataclass
class RankRun:
    """What one rank trains with: built once by ``run_rank``, shared by the functions below."""

    plan: RankPlan  # the plan of the current world size (Horovod elastic replaces it after a reset)
    group: Any  # training.distributed: LocalGroup, HorovodGroup or TorchGroup
    strategy: Any  # training.strategies.base.Strategy
    model: torch.nn.Module  # the plain module: state dicts, validation and export, the same on every strategy
    step_model: torch.nn.Module  # what a training step calls: DDP/FSDP on the torch backend, else ``model``
    optimizer: torch.optim.Optimizer
    objective: Objective
    checkpoints: CheckpointManager
    guard: NonFiniteGuard
    launch_identity: dict  # the identity of the launch's own plan: what a checkpoint to resume must match
    meta: dict = field(default_factory=dict)  # the identity written into this plan's checkpoints
    timer: StepTimer = field(default_factory=StepTimer)
    recorder: Recorder | None = None  # rank 0 only
    restored: dict = field(default_factory=lambda: {"uri": None, "step": 0, "problems": []})
    user: UserObjective = field(default_factory=UserObjective)  # the user's loss and metrics (training.user_code)
    user_metric_names: list = field(default_factory=list)  # their metrics' names, from the probe batch

    @property
    def device(self) -> torch.device:
        return self.group.device

    @property
    def precision(self):
        return self.strategy.precision

    @property
    def total_steps(self) -> int:
        return self.plan.config.train.epochs * self.plan.steps_per_epoch

    def on_device(self, batch: dict) -> dict:
        """``batch`` on this rank's device (as is on the CPU)."""
        if self.device.type == "cpu":
            return batch
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def start(self) -> "TrainState":
        """The state the launch starts from: the newest good checkpoint of this run, or step 0."""
        outcome = restore(self.plan, self.group, self.checkpoints, self.launch_identity)
        self.restored = {"uri": outcome["uri"], "step": outcome["step"], "problems": outcome["problems"]}
        return TrainState.resume(outcome["state"], self) if outcome["state"] else TrainState.fresh(self.device)

    def epoch_start(self, history: list[dict], plan: RankPlan) -> "TrainState":
        """A fresh state at the start of the first epoch ``history`` lacks, in steps of ``plan``."""
        return TrainState.fresh(self.device, history, step=len(history) * plan.steps_per_epoch)

    def adopt(self, plan: RankPlan, start_step: int) -> None:
        """Train by ``plan`` from ``start_step`` on (after a Horovod elastic reset: the new rank and size)."""
        self.plan = plan
        self.meta = run_identity(plan)
        self.checkpoints.steps_per_epoch = plan.steps_per_epoch
        self.checkpoints.is_writer = self.group.rank == 0
        self.recorder = Recorder(plan) if self.group.rank == 0 else None
        if self.recorder:
            self.recorder.begin(plan, start_step)
        self.strategy.begin(plan, start_step, self.model)


@dataclass
class TrainState:
    """Where this rank's run stands, beyond the tensors of model, optimizer and scaler."""

    step: int  # optimizer steps done (all epochs)
    history: list[dict]  # one record per finished epoch
    # This rank's own sum of finite step losses in the current epoch, on the device (no sync per
    # step), and how many of its step losses were NaN/inf (fp16 steps the loss scaler skipped):
    # left out of the sum, so one overflow does not turn the epoch's train_loss into NaN.
    # Kept per rank in checkpoints: a rank-0-only sum, broadcast on resume, would count rank 0's share W times.
    epoch_loss_sum: torch.Tensor
    epoch_non_finite: torch.Tensor

    @classmethod
    def fresh(cls, device, history: list[dict] | None = None, step: int = 0) -> "TrainState":
        return cls(step=step, history=list(history or []),
                   epoch_loss_sum=torch.zeros((), dtype=torch.float64, device=device),
                   epoch_non_finite=torch.zeros((), dtype=torch.float64, device=device))

    @classmethod
    def resume(cls, saved: dict, run: RankRun) -> "TrainState":
        """Load a checkpoint's model, optimizer, scaler and this rank's RNG; the state it was saved at."""
        run.strategy.load_state_dicts(run.model, run.optimizer, saved["model"], saved["optimizer"])
        run.precision.load_state_dict(saved["scaler"])
        mine = saved_rank(saved["ranks"], run.group, run.strategy.dp_rank)
        run.strategy.load_rank_state(mine.get("strategy", {}), run.model, run.optimizer)
        torch.set_rng_state(mine["rng"]["cpu"])
        if "cuda" in mine["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state(mine["rng"]["cuda"])
        return cls(step=int(saved["step"]), history=list(saved["history"]),
                   epoch_loss_sum=torch.tensor(float(mine["epoch_loss"]), dtype=torch.float64, device=run.device),
                   epoch_non_finite=torch.tensor(float(mine.get("epoch_non_finite", 0)), dtype=torch.float64,
                                                 device=run.device))

    def begin_epoch(self, epoch: int, steps_per_epoch: int) -> int:
        """Steps of ``epoch`` already done (non-zero only when resuming mid-epoch)."""
        done = self.step - epoch * steps_per_epoch
        if not done:
            self.epoch_loss_sum.zero_()
            self.epoch_non_finite.zero_()
        return done

    def add_step(self, loss: torch.Tensor) -> None:
        self.step += 1
        loss = loss.detach().double()
        finite = torch.isfinite(loss)
        self.epoch_loss_sum += torch.where(finite, loss, torch.zeros_like(loss))
        self.epoch_non_finite += (~finite).double()

    def checkpoint(self, run: RankRun) -> dict:
        """The checkpoint state; every rank calls it (collectives). Refuses, on every rank together,
        to produce one from a non-finite loss or non-finite weights, so a retry never resumes poison."""
        run.guard.check(run.group, model=run.model, step=self.step)
        mine = {"rng": rng_state(run.device), "epoch_loss": float(self.epoch_loss_sum),
                "epoch_non_finite": int(self.epoch_non_finite), "dp_rank": run.strategy.dp_rank}
        strategy_state = run.strategy.rank_state(run.model, run.optimizer)
        if strategy_state:  # only strategies whose replicas differ between syncs (periodic sync)
            mine["strategy"] = strategy_state
        ranks = run.group.allgather_object(mine)
        return {"model": run.strategy.model_state_dict(run.model),
                "optimizer": run.strategy.optimizer_state_dict(run.model, run.optimizer),
                "scaler": run.precision.state_dict(), "ranks": ranks, "meta": run.meta, "history": self.history}


def train_epoch(run: RankRun, state: TrainState, loader: RankLoader, epoch: int,
                on_step: Callable[[int], None] | None = None) -> dict:
    """The rest of ``epoch``'s steps; returns the epoch's record (train loss, samples, time split).

    Writes the mid-epoch checkpoints; the epoch's last one is ``_end_epoch``'s, written once the
    record (with validation) is in the history, so a run resumed from it reports every epoch.
    """
    plan, t, strategy = run.plan, run.plan.config.train, run.strategy
    run.model.train()
    done = state.begin_epoch(epoch, plan.steps_per_epoch)
    started, first_step, timer_start = time.perf_counter(), state.step, run.timer.snapshot()
    batches = run.timer.timed(loader.epoch(epoch, skip_batches=done * t.grad_accum))
    for micro_batches in _grouped(batches, t.grad_accum):
        set_lr(run.optimizer, plan.lr, state.step, run.total_steps, t)
        loss = strategy.train_step(run.step_model, [run.on_device(b) for b in micro_batches], run.optimizer,
                                   run.objective, t.clip_norm, timer=run.timer)
        state.add_step(loss)
        strategy.after_step(state.step, run.model, run.optimizer)
        run.guard.observe(loss, state.step)
        if state.step % t.log_every_steps == 0:
            run.guard.check(run.group)  # collective, at the same steps on every rank
            if run.recorder:
                run.recorder.step(state.step, epoch, float(loss), run.timer)
        # An epoch's last step is saved by _end_epoch.
        if state.step % plan.steps_per_epoch and strategy.is_checkpoint_point(state.step):
            run.checkpoints.save(state.step, epoch, lambda: state.checkpoint(run))
        if on_step:
            on_step(state.step)
    run.guard.check(run.group)
    samples_per_step = strategy.dp_size * t.batch_size * t.grad_accum
    # Summed over the ranks that compute the loss (every rank but a pipeline's first stages).
    loss_sum, non_finite, loss_ranks = (float(v) for v in run.group.allreduce_sum(torch.stack(
        [state.epoch_loss_sum, state.epoch_non_finite,
         torch.tensor(float(strategy.computes_loss), dtype=torch.float64, device=state.epoch_loss_sum.device)]
    ).detach().cpu()))
    counted = loss_ranks * plan.steps_per_epoch - non_finite
    record = {"epoch": epoch + 1, "step": state.step,
              # The mean over ranks and steps of the finite step losses (NaN only if none was finite).
              "train_loss": loss_sum / counted if counted else math.nan,
              # Step losses (one per rank and step) that were NaN/inf: the fp16 steps the scaler skipped.
              "non_finite_losses": int(non_finite),
              "seconds": round(time.perf_counter() - started, 3),
              # Samples all ranks trained on in this epoch (this process's part of it after a resume).
              "samples": (state.step - first_step) * samples_per_step}
    record.update(run.timer.since(timer_start))
    record.update(strategy.epoch_metrics())
    return record


def _end_epoch(run: RankRun, state: TrainState, epoch: int, record: dict, stop: bool = False) -> None:
    """The record joins the history (and metrics.jsonl); then the epoch-end checkpoint, if due
    (always at the run's last step, and at an epoch the run stops after)."""
    state.history.append(record)
    if run.recorder:
        run.recorder.epoch_end(record)
    run.checkpoints.save(state.step, epoch, lambda: state.checkpoint(run),
                         last=stop or state.step == run.total_steps)


def _stop_asked(run: RankRun, hooks, record: dict) -> bool:
    """Whether the run ends at this epoch boundary: rank 0 asks its hooks (the driver), once per
    epoch; every rank gets the same answer, so all stop together."""
    stop = hooks.should_stop(record) if run.group.rank == 0 else False
    return bool(run.group.broadcast_object(stop)) if run.group.size > 1 else bool(stop)


def _build(plan: RankPlan, group) -> RankRun:
    cfg, t = plan.config, plan.config.train
    strategy = build_strategy(cfg, group)
    torch.manual_seed(t.seed)
    model = build_model(cfg.model, plan.feature_spec, plan.label_spec, plan.user_code).to(group.device)
    user, names = _probed(plan, model, group.device)
    if cfg.output.torchscript == "always":  # refused now, by every rank alike, not after training
        check_scriptable(model, plan.label_spec)
    step_model = strategy.wrap(model)
    optimizer = strategy.optimizer(make_optimizer(model, t, plan.lr), model, t.grad_accum)
    checkpoints = CheckpointManager(plan.checkpoint_uri, plan.steps_per_epoch, cfg.checkpoint.every_steps,
                                    cfg.checkpoint.every_epochs, cfg.checkpoint.keep, is_writer=group.rank == 0)
    identity = run_identity(plan)
    return RankRun(plan=plan, group=group, strategy=strategy, model=model, step_model=step_model, optimizer=optimizer,
                   objective=Objective(plan.label_spec, t.distill, user.loss), user=user, user_metric_names=names,
                   checkpoints=checkpoints,
                   guard=NonFiniteGuard(t.max_skipped_steps if t.precision == "fp16" else 0),
                   launch_identity=identity, meta=identity)


def _probed(plan: RankPlan, model, device) -> tuple[UserObjective, list[str]]:
    """The user's loss and metrics (given to train(), or the network's own), after running them and
    the model on a probe batch: their code fails here, on every rank alike, before any step. Only
    where the user's code is in play (given to train(), or a network with its own loss or metrics):
    a model's forward is called one time more, which a run of the task's loss does not need."""
    user = UserObjective.of(plan.user_code, model)
    if not (user.loss or user.metrics or plan.user_code is not None):
        return user, []
    task = label_task(plan.label_spec.task)
    probe_batch = {k: torch.from_numpy(v).to(device) for k, v in FeatureSpec(plan.feature_spec).probe(2).items()}
    probe_batch["label"] = torch.zeros((2, *task.label_shape(plan.label_spec.num_classes)),
                                       dtype=getattr(torch, task.label_dtype), device=device)
    where = ", ".join(f"{role} {name}" for role, name in (plan.user_code.names.items() if plan.user_code else
                                                         [("model.name", plan.config.model.name)]))
    return user, probe(model, user, probe_batch, where, plan.user_code.lines if plan.user_code else None)


# --- helpers -----------------------------------------------------------------------------------

def _grouped(batches, size: int):
    group = []
    for batch in batches:
        group.append(batch)
        if len(group) == size:
            yield group
            group = []


def loaders(plan: RankPlan, strategy) -> tuple[RankLoader, RankLoader | None]:
    """The rank's training loader and its validation loader (None without a val split), sharded by
    the strategy's data-parallel rank and size. They share one BufferMemory: they never build
    buffers at the same time."""
    d, t = plan.config.data, plan.config.train
    memory = BufferMemory()

    def loader(layout, accum: int, shuffle: bool, augments: dict) -> RankLoader:
        return RankLoader(layout, plan.columns, strategy.dp_rank, strategy.dp_size, t.batch_size, accum, seed=t.seed,
                          shuffle=shuffle, shuffle_buffer_rows=d.shuffle_buffer_rows,
                          reader_workers=d.reader_workers, prefetch_row_groups=d.prefetch_row_groups,
                          reader=d.reader, memory=memory, shuffle_buffer_bytes=d.shuffle_buffer_bytes,
                          decode_workers=d.decode_workers, augments=augments)

    augments = {column: ImageAugment.from_config(cfg) for column, cfg in d.augment.items()}  # the train split's only
    return loader(plan.train, t.grad_accum, True, augments), loader(plan.val, 1, False, {}) if plan.val else None


def _quiet_libraries() -> None:
    # petastorm on pyarrow 14 warns on every reader about deprecated legacy-dataset calls.
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    if not logging.getLogger("shardtrain").handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.getLogger("shardtrain").addHandler(handler)
        logging.getLogger("shardtrain").setLevel(logging.INFO)
    logging.getLogger("petastorm").setLevel(logging.WARNING)


__all__ = ["Hooks", "OneAttempt", "RankRun", "TrainState", "loaders", "run_rank", "train_epoch"]
