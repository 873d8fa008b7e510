"""The ``Strategy`` interface and its default: every rank holds the whole, unwrapped model.

``Strategy.train_step`` is the one optimizer step every technique shares (nanoGPT's AMP +
accumulation + data-parallel path); a strategy changes it by overriding the small pieces it calls
(``accumulate``, ``synchronize``, ``skip_synchronize``) or, where a step has another shape
altogether (pipeline schedules), the step itself. The fp16 order matters on every backend: the
gradient synchronisation finishes before the gradients are unscaled and clipped, and the update
must not start a second one (see ``training.precision``).

A strategy class also declares what the driver reads before anything launches: the technique it
is (``name``), the key that picks it, the kinds of rank group it trains on (a launcher's
``ranks``), its own refusals (``check``) and how it divides the world and the model. So the
driver imports strategy modules for their declarations, config sections and checks, and torch is
imported inside the methods a rank runs: none of these modules imports it at import time.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch


class Strategy:
    """How one rank trains in parallel with the others of its ``group``.

    ``group``: the rank group (``training.distributed``: rank, size, device, collectives).
    ``precision``: the one precision policy (``training.precision.Precision``); a strategy that
    needs it in another form (FSDP's mixed-precision policy) asks it, never decides it.
    ``config``: the run's typed ``TrainConfig``, for a strategy's own keys (``train.sync``).
    """

    name = "single"  # the technique, as training.strategies.REGISTRY and the config name it
    key: str | None = None  # the config key whose value picks it, as a refusal names it
    ranks: tuple[str, ...] = ()  # the kinds of rank group it trains on (a launcher's ``ranks``)

    # --- what the driver reads, before anything launches ------------------------------------------

    @classmethod
    def picked(cls, train) -> bool:
        """Whether ``train`` (a ``TrainLoopConfig``) asks for this technique: its key names it."""
        return key_value(train, cls.key) == cls.name

    @classmethod
    def check(cls, cfg, launcher) -> None:
        """Refuse (exit 2, naming the key and what to set) what this technique cannot run with
        ``cfg`` (a ``TrainConfig``) on ``launcher`` (``training.launchers.base.Launcher``)."""

    @classmethod
    def ranks_per_replica(cls, train) -> int:
        """Ranks that hold one copy of the model together (the world divided by it is the
        data-parallel size: what rows are sharded by and equal steps computed from)."""
        return 1

    @classmethod
    def model_shards(cls, cfg) -> int:
        """Ranks that one copy of the model's weights, gradients and optimizer state is divided
        among (``training.model_shape``'s memory check)."""
        return 1

    def __init__(self, group, precision, config=None):
        self.group = group
        self.precision = precision
        self.config = config
        self.device = group.device

    @classmethod
    def from_config(cls, config, group, precision) -> "Strategy":
        """The strategy for a rank of ``config`` (a ``TrainConfig``); one that has settings of its
        own (pipeline stages) reads them here."""
        return cls(group, precision, config)

    # --- where this rank stands ------------------------------------------------------------------

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel replicas: what the loader shards rows by."""
        return self.group.rank

    @property
    def dp_size(self) -> int:
        """How many data-parallel replicas read different rows (equal steps are computed from it)."""
        return self.group.size

    @property
    def computes_loss(self) -> bool:
        """Whether this rank's step returns the real loss; the epoch's mean counts only the ranks
        that do (the pipeline strategy reduces the loss over its stages, so all of its ranks do)."""
        return True

    # --- building ----------------------------------------------------------------------------------

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """What a training step calls; ``model`` stays the plain module (state dicts, validation)."""
        return model

    def optimizer(self, optimizer, model, grad_accum: int):
        """The optimizer a step uses (Horovod: its DistributedOptimizer around ``optimizer``)."""
        return optimizer

    def broadcast_initial_state(self, model, optimizer) -> None:
        """Rank 0's parameters, buffers and optimizer state on every rank (one starting point)."""

    def begin(self, plan, start_step: int, model) -> None:
        """Training by ``plan`` starts (or starts again) at ``start_step``, the model in place."""

    # --- one optimizer step ------------------------------------------------------------------------

    def train_step(self, step_model, micro_batches: list[dict], optimizer,
                   objective: Callable[[torch.Tensor, dict], torch.Tensor], clip_norm: float | None,
                   timer=None) -> torch.Tensor:
        """One optimizer step over ``len(micro_batches)`` accumulated micro-batches; returns this
        rank's mean loss as a device tensor (reading it would be a CPU-GPU sync point).
        ``objective(output, batch)``: the loss of one micro-batch."""
        import torch

        precision = self.precision
        accum = len(micro_batches)
        total = torch.zeros((), device=micro_batches[0]["label"].device)
        for i, batch in enumerate(micro_batches):
            with self.accumulate(step_model, sync=i == accum - 1):  # DDP: allreduce only in the last backward
                with precision.autocast():
                    # Divided by accum so the summed gradients are those of the mean over the whole step.
                    loss = objective(step_model(batch), batch) / accum
                precision.backward(loss)  # Horovod starts the allreduce after the last micro-batch's backward
            total += loss.detach().float()
        sync_started = time.perf_counter()
        self.synchronize(optimizer)  # the averaged gradients are in place after this
        if timer:
            timer.allreduce_wait_seconds += self.allreduce_wait(sync_started)
        precision.unscale_(optimizer)
        if clip_norm:
            torch.nn.utils.clip_grad_norm_(step_model.parameters(), clip_norm)
        with self.skip_synchronize(optimizer):  # the allreduce already happened; step must not start another
            precision.step(optimizer)
        precision.update()
        optimizer.zero_grad()  # set_to_none by default; Horovod's wrapper takes no arguments
        return total

    def evaluate_forward(self, model, batch: dict) -> torch.Tensor | None:
        """The model's output on one validation batch, or None on a rank that does not compute
        it (a pipeline's earlier stages): the loop then counts nothing for that batch."""
        return model(batch)

    def accumulate(self, step_model, sync: bool):
        """The context of one micro-batch's backward; ``sync``: the step's last one."""
        return contextlib.nullcontext()

    def synchronize(self, optimizer) -> None:
        """Wait until the averaged gradients are in place."""

    def allreduce_wait(self, synchronize_started: float) -> float:
        """Seconds the step waited for the gradient synchronisation backward did not hide."""
        return 0.0

    def skip_synchronize(self, optimizer):
        return contextlib.nullcontext()

    def after_step(self, step: int, model, optimizer) -> None:
        """Runs on every rank after each optimizer step (``step``: steps done so far)."""

    def is_checkpoint_point(self, step: int) -> bool:
        """Whether the state after ``step`` is one every rank agrees on, safe to save and resume."""
        return True

    def epoch_metrics(self) -> dict:
        """The strategy's own figures for the epoch's record (every rank calls it: it may reduce)."""
        return {}

    # --- state for checkpoints and export ----------------------------------------------------------
    # Checkpoints and exports hold full state dicts in the plain module's format whatever the
    # strategy, so a run saved under one strategy resumes under another and exports the same model.

    def model_state_dict(self, model) -> dict:
        return model.state_dict()

    def optimizer_state_dict(self, model, optimizer) -> dict:
        return optimizer.state_dict()

    def load_state_dicts(self, model, optimizer, model_state: dict, optimizer_state: dict) -> None:
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)

    def rank_state(self, model, optimizer) -> dict:
        """What this rank holds that differs from the others' and a resume needs (checkpoints keep
        one per rank beside the shared state)."""
        return {}

    def load_rank_state(self, state: dict, model, optimizer) -> None:
        """The inverse of ``rank_state`` (``state`` is {} in checkpoints written without it)."""

    def unsharded(self, model, build: Callable[[], torch.nn.Module]):
        """A plain module with the trained weights for export on rank 0 (others may get None)."""
        return model


def initialise_optimizer_state(optimizer) -> None:
    """One optimizer step on zero gradients (Horovod's way of creating the state to broadcast), so
    every backend starts from the same optimizer state (Adam's step count included)."""
    import torch

    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad()


def key_value(train, key: str):
    """The value of ``key`` (``train.sync.mode``) in ``train``, the config's ``train`` section."""
    value = train
    for part in key.split(".")[1:]:
        value = getattr(value, part)
    return value


__all__ = ["Strategy", "initialise_optimizer_state", "key_value"]
