"""Periodic synchronisation (``train.sync.mode``: ``local_sgd``, ``diloco``): every replica holds
the whole model and takes ``train.sync.every`` optimizer steps on its own gradients, then the
replicas agree. What replaces the every-step gradient allreduce when the network, not compute,
bounds a step (executors in different racks or zones).

- ``LocalSGD``: the replicas' weights are averaged (after ``warmup_steps`` of every-step
  gradient averaging: post-local SGD).
- ``DiLoCo``: the replicas' change over the round, averaged, is the gradient of an outer
  optimizer (SGD with Nesterov momentum) on the global weights; every replica then starts the
  next round from them. With ``overlap`` the average runs in the background while the next round
  trains and is applied one round late (streaming DiLoCo's overlap): each replica keeps its own
  last round's progress on top of the new global weights. The staleness is exactly one round, set
  by the schedule and never by timing, so a run stays deterministic and resumable bit for bit.

No free-running parameter server: measured here, one diverged at DDP's settings and was not
reproducible, and with equal steps per rank and Spark's all-or-nothing restarts it buys nothing.

The schedule is a pure function of the step: a step syncs if it is within the warm-up, a multiple
of ``every``, or an epoch's last. So every epoch ends with the replicas equal (checkpoints,
validation and the exported model see the consensus), and a resumed run syncs where the
uninterrupted one did. Checkpoint points are sync steps (epoch ends only, with ``overlap``). Each
replica's own optimizer (and loss-scaler) state differs between syncs, so checkpoints keep one
per rank (``rank_state``); DiLoCo adds the outer optimizer's.

The collectives are the rank group's ``average_`` on one flat vector of the model's floating
tensors (Gloo or NCCL under torch.distributed, ``hvd.allreduce_async_`` under Horovod): no
DistributedDataParallel or DistributedOptimizer, whose every-step allreduce this replaces (and
unlike torch's post-local SGD hook, whose default subgroup is "each machine", which on one host
is the whole job: local SGD that silently stays every-step DDP).

This module owns ``train.sync`` (``SyncConfig``) and the refusals of its combinations; torch is
imported by the methods a rank runs (the driver imports this module for them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from common.config import require, setting
from common.errors import ConfigError
from training.strategies.base import Strategy

if TYPE_CHECKING:
    import torch


@dataclass
class OuterOptimizerConfig:
    """DiLoCo's outer optimizer: SGD on the replicas' averaged change since the last sync."""

    lr: float = setting("`diloco`: the outer optimizer's learning rate", default=0.7)
    momentum: float = setting("`diloco`: the outer optimizer's momentum, in [0, 1)", default=0.9)
    nesterov: bool = setting("`diloco`: Nesterov momentum (needs momentum above 0)", default=True)

    def __post_init__(self):
        require(self.lr > 0 and math.isfinite(self.lr), "lr", f"must be > 0, got {self.lr}")
        require(0 <= self.momentum < 1, "momentum", f"must be in [0, 1), got {self.momentum}")
        require(not self.nesterov or self.momentum > 0, "nesterov", "needs momentum > 0")


@dataclass
class SyncConfig:
    """How often the data-parallel replicas agree.

    every_step: gradients averaged at every optimizer step (DDP, Horovod). local_sgd: each replica
    takes ``every`` optimizer steps on its own, then the replicas' weights are averaged, after
    ``warmup_steps`` of every-step averaging (post-local SGD). diloco: the same rounds, but the
    averaged change of a round is applied by the ``outer`` optimizer (Nesterov momentum), and with
    ``overlap`` its average is computed while the next round trains and applied one round late.
    Every epoch ends with a sync, so checkpoints, validation and the exported model see the consensus.
    """

    mode: Literal[SYNC_MODES] = setting(
        "`every_step`: gradients averaged at every step; `local_sgd` or `diloco`: the replicas take `every` "
        "steps on their own between syncs; `train.parallel=ddp` only, not with `launch.elastic`",
        default="every_step")
    every: int = setting("local steps per round: a step syncs if it is a multiple of `every` or an epoch's last",
                         default=8)
    warmup_steps: int = setting("every-step gradient averaging for the first steps (post-local SGD)", default=0)
    outer: OuterOptimizerConfig = setting(
        "`diloco`: the outer optimizer over the averaged change of each round", default_factory=OuterOptimizerConfig)
    overlap: bool = setting(
        "`diloco`: a round's average runs while the next round trains and is applied one round late "
        "(deterministic: the staleness is one round by schedule); checkpoints at epoch ends only", default=False)

    def __post_init__(self):
        require(1 <= self.every <= 1_000_000, "every", f"must be in [1, 1000000], got {self.every}")
        require(self.warmup_steps >= 0, "warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        require(not self.overlap or self.mode == "diloco", "overlap",
                f"applies to mode=diloco only (got mode={self.mode}); set train.sync.overlap=false")


class PeriodicSync(Strategy):
    """What local SGD and DiLoCo share: the schedule, the warm-up, the per-rank state, the figures."""

    key, ranks = "train.sync.mode", ("torch", "horovod")
    parallel = "ddp"  # the train.parallel the rounds need: replicas, each holding the whole model

    @classmethod
    def check(cls, cfg, launcher) -> None:
        sync = cfg.train.sync
        if cfg.train.parallel != cls.parallel:
            raise ConfigError(f"train.sync.mode={sync.mode} needs train.parallel={cls.parallel} (got "
                              f"{cfg.train.parallel}): FSDP2 shards one model across all ranks, so there are no "
                              f"replicas to average in rounds; set train.parallel={cls.parallel} or "
                              "train.sync.mode=every_step")
        if cfg.launch.elastic:
            raise ConfigError(f"launch.elastic does not combine with train.sync.mode={sync.mode} (a reset would drop "
                              "the replicas' own optimizer state and the rounds' schedule); set launch.elastic=false or "
                              "train.sync.mode=every_step")
        every_steps = cfg.checkpoint.every_steps
        if sync.overlap and every_steps is not None:
            raise ConfigError("checkpoint.every_steps must be null with train.sync.overlap=true: a round's average is "
                              "still in flight mid-epoch, so only epoch ends are checkpoint points "
                              "(checkpoint.every_epochs)")
        if not sync.overlap and every_steps is not None and every_steps % sync.every:
            raise ConfigError(f"checkpoint.every_steps must be a multiple of train.sync.every={sync.every} with "
                              f"train.sync.mode={sync.mode}: only steps where the replicas agree are checkpoint points")

    def __init__(self, group, precision, config):
        super().__init__(group, precision, config)
        sync = config.train.sync
        self.every, self.warmup = sync.every, sync.warmup_steps
        self.steps_per_epoch = 1
        self.step = 0  # optimizer steps done
        self._reset_figures()

    # --- the schedule -------------------------------------------------------------------------------

    def is_sync_step(self, step: int) -> bool:
        return step <= self.warmup or step % self.every == 0 or step % self.steps_per_epoch == 0

    def is_checkpoint_point(self, step: int) -> bool:
        return self.is_sync_step(step)

    def begin(self, plan, start_step: int, model) -> None:
        self.steps_per_epoch = plan.steps_per_epoch
        self.step = start_step

    def broadcast_initial_state(self, model, optimizer) -> None:
        # Every rank built the same seeded model or loaded the same checkpoint; this makes sure.
        vector = flatten(model)
        self.group.broadcast_(vector)
        unflatten(vector, model)

    def synchronize(self, optimizer) -> None:
        """Within the warm-up, the gradients are averaged every step (the replicas stay equal)."""
        if self.step + 1 > self.warmup:
            return  # a local step: nothing leaves this rank
        import torch

        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        vector = torch.cat([g.reshape(-1) for g in grads])
        self._average(vector)
        offset = 0
        for g in grads:
            g.copy_(vector[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def after_step(self, step: int, model, optimizer) -> None:
        self.step = step
        self._steps += 1
        if step > self.warmup and self.is_sync_step(step):
            self.sync(model, epoch_end=step % self.steps_per_epoch == 0)
            self._rounds += 1

    def sync(self, model, epoch_end: bool) -> None:
        raise NotImplementedError

    # --- per-rank state -----------------------------------------------------------------------------

    def rank_state(self, model, optimizer) -> dict:
        # Between syncs each replica's optimizer (and fp16 loss scale) followed its own gradients.
        return {"optimizer": optimizer.state_dict(), "scaler": self.precision.state_dict()}

    def load_rank_state(self, state: dict, model, optimizer) -> None:
        if "optimizer" in state:
            optimizer.load_state_dict(state["optimizer"])
        if "scaler" in state:
            self.precision.load_state_dict(state["scaler"])

    # --- figures ------------------------------------------------------------------------------------

    def _average(self, vector: torch.Tensor, background: bool = False):
        self._collectives += 1
        self._bytes += vector.numel() * vector.element_size()
        return self.group.average_(vector, background=background)

    def _note_drift(self, before: torch.Tensor, after: torch.Tensor) -> None:
        """How far this replica was from the consensus when it synced (L2 over all weights)."""
        self._drift_sum += float((before - after).norm())
        self._drifts += 1

    def _reset_figures(self) -> None:
        self._rounds = self._collectives = self._bytes = self._steps = self._drifts = 0
        self._drift_sum = 0.0

    def epoch_metrics(self) -> dict:
        """This epoch's sync rounds and collectives (each rank's), the bytes each rank sent per
        sample it trained on, and the replicas' mean drift from the consensus at a sync."""
        import torch

        t = self.config.train
        drift_sum, drifts = (float(v) for v in self.group.allreduce_sum(
            torch.tensor([self._drift_sum, float(self._drifts)], dtype=torch.float64)))
        samples = self._steps * t.batch_size * t.grad_accum
        figures = {"sync_rounds": self._rounds, "sync_collectives": self._collectives,
                   "sync_bytes_per_sample": round(self._bytes / samples, 3) if samples else 0.0,
                   "sync_drift": drift_sum / drifts if drifts else 0.0}
        self._reset_figures()
        return figures


class LocalSGD(PeriodicSync):
    name = "local_sgd"

    def sync(self, model, epoch_end: bool) -> None:
        vector = flatten(model)
        before = vector.clone()
        self._average(vector)
        self._note_drift(before, vector)
        unflatten(vector, model)


class DiLoCo(PeriodicSync):
    name = "diloco"

    def __init__(self, group, precision, config):
        super().__init__(group, precision, config)
        sync = config.train.sync
        self.outer_cfg, self.overlap = sync.outer, sync.overlap
        self.global_weights: torch.nn.Parameter | None = None  # the outer optimizer's parameter
        self.outer = None
        self._outer_state: dict | None = None  # loaded from a checkpoint before ``begin``
        self.round_start: torch.Tensor | None = None  # this replica's weights when its round began
        self._pending = None  # (averaged change, its collective, this rank's own change) in flight

    def begin(self, plan, start_step: int, model) -> None:
        super().begin(plan, start_step, model)
        import torch

        # A start or resume is always at a sync point: the model holds the global weights.
        weights = flatten(model)
        self.global_weights = torch.nn.Parameter(weights.clone(), requires_grad=False)
        c = self.outer_cfg
        self.outer = torch.optim.SGD([self.global_weights], lr=c.lr, momentum=c.momentum, nesterov=c.nesterov)
        if self._outer_state:
            self.outer.load_state_dict(self._outer_state)
        self.round_start = weights
        self._pending = None

    def sync(self, model, epoch_end: bool) -> None:
        local = flatten(model)
        change = self.round_start - local  # the round's pseudo-gradient: minus this replica's progress
        self._apply_pending()
        if epoch_end or not self.overlap:
            own = change.clone()
            self._average(change)
            self._note_drift(own, change)
            self._outer_step(change)
            local = self.global_weights.detach().clone()
        else:
            progress = local - self.round_start
            own = change.clone()
            self._pending = (change, self._average(change, background=True), own)
            # The last round's average just moved the global weights; this round's own progress
            # stays on top of them until its average lands, one round from now.
            local = self.global_weights.detach() + progress
        self.round_start = local.clone()
        unflatten(local, model)

    def _apply_pending(self) -> None:
        if self._pending is None:
            return
        change, collective, own = self._pending
        self._pending = None
        collective.wait()
        self._note_drift(own, change)
        self._outer_step(change)

    def _outer_step(self, averaged_change: torch.Tensor) -> None:
        self.global_weights.grad = averaged_change
        self.outer.step()
        self.global_weights.grad = None

    def rank_state(self, model, optimizer) -> dict:
        return {**super().rank_state(model, optimizer), "outer": self.outer.state_dict()}

    def load_rank_state(self, state: dict, model, optimizer) -> None:
        super().load_rank_state(state, model, optimizer)
        self._outer_state = state.get("outer")


def _floating(model) -> list[torch.Tensor]:
    """The tensors replicas agree on: parameters and floating buffers, in a fixed order."""
    return [p.data for p in model.parameters()] + [b for b in model.buffers() if b.is_floating_point()]


def flatten(model) -> torch.Tensor:
    """A new flat vector of the model's floating tensors (fp32: the weights are fp32 whatever the precision)."""
    import torch

    return torch.cat([t.detach().reshape(-1).float() for t in _floating(model)])


def unflatten(vector: torch.Tensor, model) -> None:
    import torch

    offset = 0
    with torch.no_grad():
        for t in _floating(model):
            t.copy_(vector[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


# train.sync.mode's choices: every step (no rounds: train.parallel's strategy), or one of these.
SYNC_MODES = ("every_step", LocalSGD.name, DiLoCo.name)

__all__ = ["DiLoCo", "LocalSGD", "OuterOptimizerConfig", "PeriodicSync", "SYNC_MODES", "SyncConfig", "flatten",
           "unflatten"]
