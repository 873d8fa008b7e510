"""One rank's training under Horovod elastic (``launch.elastic: true``): when a rank dies, the
others go on at the smaller world size without a relaunch.

The same loop as ``training.loop.run_rank`` (its functions: build, restore, ``train_epoch``,
``evaluate``, publish), inside ``@hvd.elastic.run``. The elastic state (model, optimizer, the
finished epochs' records) is committed in memory at each epoch end, the loop's checkpoint
boundary. After a reset every survivor rolls back to the last commit, re-plans for the new
world size (``RankPlan.for_world``: the split's rows divided into equal steps again, every rank
the same number) and repeats the interrupted epoch with fresh loaders for its new rank. Rank 0
logs the old and new world size; the driver's supervisor logs which rank's process went away.

Checkpoints written after a reset record the new world size, so a later full relaunch
(``launch.max_restarts``) at the configured size refuses the newest of them as another run's
(exit 2, as ``training.loop._restore`` does for any identity mismatch).

Rank-side only; imports torch and horovod.
"""

from __future__ import annotations

import logging
from typing import Callable

from training import loop
from training.plan import RankPlan
from training.run_record import write_run_info

log = logging.getLogger("shardtrain.train")


def run_rank_elastic(plan: RankPlan, group, on_step: Callable[[int], None] | None = None,
                     on_validation: Callable[[int | None], None] | None = None) -> dict:
    """``run_rank`` for a ``HorovodGroup`` under Horovod elastic; returns the same values.

    Every collective runs inside ``attempt``: a rank that joins later (Spark re-ran a dead rank's
    task) takes the others' state from Horovod's sync and must not run a collective they do not.
    """
    import horovod.torch as hvd

    loop._quiet_libraries()
    device, device_reason = loop._pick_device(group, plan)
    loop.set_threads(group.local_size)
    run = loop._build(plan, group, device)
    identity = loop._run_identity(plan)  # what the checkpoints of the launch's start belong to
    if group.rank == 0:
        loop._write_run_files(plan)
    # commits == 0 until the launch's start has resumed from storage; synced from rank 0, like all of it.
    elastic = hvd.elastic.TorchState(model=run.model, optimizer=run.optimizer, step=0, history=[],
                                     world=group.size, commits=0)
    restored = {"uri": None, "step": 0, "problems": []}

    @hvd.elastic.run
    def attempt(elastic) -> dict:
        group.refresh()
        here = plan.for_world(group.size)
        if not elastic.commits:  # the launch's start: resume from the newest checkpoint, as run_rank does
            restored.update(loop._restore(plan, group, run.checkpoints, identity))
            state = (loop.TrainState.resume(restored["state"], run) if restored["state"]
                     else loop.TrainState.fresh(device))
            if group.size != plan.world_size:  # a rank left before the start was committed
                state = _epoch_start(state, here, device)
        else:
            # A reset (a rank left or joined): back to the last commit, an epoch end, at the new size.
            if group.rank == 0:
                log.warning("elastic reset: world size %d -> %d; epoch %d starts again with %d steps on every rank",
                            elastic.world, group.size, len(elastic.history) + 1, here.steps_per_epoch)
            state = loop.TrainState.fresh(device)
            state.history = list(elastic.history)
            state = _epoch_start(state, here, device)
        _adopt(run, here, group, state.step)
        _commit(elastic, state, group.size)
        return _train(run, here, group, state, elastic, device, on_step, on_validation)

    result = attempt(elastic)
    result.update({"device_reason": device_reason, "resumed_from": restored["uri"],
                   "resumed_step": restored["step"], "checkpoint_problems": restored["problems"]})
    return result


def _epoch_start(state, plan: RankPlan, device):
    """The start of the first unfinished epoch, in steps of ``plan`` (its world size)."""
    fresh = loop.TrainState.fresh(device)
    fresh.history = list(state.history)
    fresh.step = len(state.history) * plan.steps_per_epoch
    return fresh


def _commit(elastic, state, world: int) -> None:
    elastic.step, elastic.history, elastic.world = state.step, list(state.history), world
    elastic.commits += 1
    elastic.commit()  # every rank; raises HostsUpdatedInterrupt when a rank joined or left


def _adopt(run, plan: RankPlan, group, step: int) -> None:
    """Point the rank's run at the plan for the current world size (after a reset: new rank, size)."""
    run.plan = plan
    run.meta = loop._run_identity(plan)
    run.checkpoints.steps_per_epoch = plan.steps_per_epoch
    run.checkpoints.is_writer = group.rank == 0
    run.progress = loop.Progress(plan, group.size, run.total_steps, step) if group.rank == 0 else None
    if group.rank == 0:  # run.json (the report's world size, steps per epoch) follows the world size
        write_run_info(plan)


def _train(run, plan: RankPlan, group, state, elastic, device, on_step, on_validation) -> dict:
    t = plan.config.train
    train_loader, val_loader = loop.loaders(plan, group)
    for epoch in range(state.step // plan.steps_per_epoch, t.epochs):
        loop.check_manifest_unchanged(plan.dataset_uri, plan.fingerprint)  # as run_rank: the planned dataset
        record = loop.train_epoch(run, state, train_loader, epoch, on_step)
        if val_loader:
            record.update(loop.evaluate(run.model, val_loader, run.precision, group, plan, device, on_validation))
        loop._end_epoch(run, state, epoch, record)
        _commit(elastic, state, group.size)
    result = {"rank": group.rank, "device": str(device), "gpu_addresses": loop.spark_gpu_addresses(),
              "steps": state.step, "steps_per_epoch": plan.steps_per_epoch, "world_size": group.size,
              "epoch_stats": [stats.__dict__ for stats in train_loader.stats]}
    if group.rank == 0:
        result.update(loop._finish(plan, run.model, state.history, device))
        loop._report_and_track(plan, state.history)  # what every run writes: report.html, MLflow
    return result


__all__ = ["run_rank_elastic"]
