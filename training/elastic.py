"""Horovod elastic (``launch.elastic: true``) as the rank loop's ``Attempts``: when a rank dies,
the others go on at the smaller world size without a relaunch.

The loop is ``training.loop``'s, unchanged; this module only decides where each attempt starts.
The elastic state (model, optimizer, the finished epochs' records) is committed in memory at each
epoch end, the loop's checkpoint boundary. After a reset every survivor rolls back to the last
commit, re-plans for the new world size (``RankPlan.for_world``: the split's rows divided into
equal steps again, every rank the same number) and repeats the interrupted epoch with fresh
loaders for its new rank; the recorder starts again at that plan (run.json follows the world
size). Rank 0 logs the old and new world size; the driver's supervisor logs which rank's process
went away.

Checkpoints written after a reset record the new world size, so a later full relaunch
(``launch.max_restarts``) at the configured size refuses the newest of them as another run's
(exit 2, as ``training.loop`` does for any identity mismatch).

Rank-side only; imports horovod when an attempt runs. It does not import ``training.loop``: the
loop hands it the rank's ``RankRun`` and the body to run.
"""

from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger("shardtrain.train")


class HorovodElastic:
    """Attempts of one Horovod elastic rank (``group``: its ``HorovodGroup``)."""

    def __init__(self, group):
        self.group = group
        self.elastic = None  # hvd.elastic.TorchState, made in ``run``

    def run(self, run, body: Callable) -> dict:
        """Every collective runs inside ``attempt``: a rank that joins later (Spark re-ran a dead
        rank's task) takes the others' state from Horovod's sync and must not run a collective
        they do not."""
        import horovod.torch as hvd

        group, launch_plan = self.group, run.plan
        # commits == 0 until the launch's start has resumed from storage; synced from rank 0, like all of it.
        self.elastic = hvd.elastic.TorchState(model=run.model, optimizer=run.optimizer, step=0, history=[],
                                              world=group.size, commits=0)

        @hvd.elastic.run
        def attempt(elastic) -> dict:
            group.refresh()
            here = launch_plan.for_world(group.size)
            if not elastic.commits:  # the launch's start: resume from the newest checkpoint
                state = run.start()
                if group.size != launch_plan.world_size:  # a rank left before the start was committed
                    state = run.epoch_start(state.history, here)
            else:
                # A reset (a rank left or joined): back to the last commit, an epoch end, at the new size.
                if group.rank == 0:
                    log.warning("elastic reset: world size %d -> %d; epoch %d starts again with %d steps on every "
                                "rank", elastic.world, group.size, len(elastic.history) + 1, here.steps_per_epoch)
                state = run.epoch_start(elastic.history, here)
            run.adopt(here, state.step)
            self.commit(state)
            return body(state)

        return attempt(self.elastic)

    def commit(self, state) -> None:
        """Every rank at each epoch end; raises HostsUpdatedInterrupt when a rank joined or left."""
        elastic = self.elastic
        elastic.step, elastic.history, elastic.world = state.step, list(state.history), self.group.size
        elastic.commits += 1
        elastic.commit()


__all__ = ["HorovodElastic"]
