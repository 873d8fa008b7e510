"""Horovod data parallel: every rank holds the whole model; Horovod's DistributedOptimizer
averages the gradients, starting each allreduce during backward.

Gradients are summed locally for ``grad_accum`` micro-batches, then averaged across ranks in one
allreduce (``backward_passes_per_step``): accumulation costs no extra communication.

Imports neither torch nor horovod itself: the rank group brings them (the driver imports this
module for the declarations).
"""

from __future__ import annotations

import time

from training.strategies.base import Strategy


class HorovodDataParallel(Strategy):
    name, key, ranks = "ddp", "train.parallel", ("horovod",)

    def optimizer(self, optimizer, model, grad_accum: int):
        hvd = self.group.hvd
        return hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                        backward_passes_per_step=grad_accum, op=hvd.Average)

    def broadcast_initial_state(self, model, optimizer) -> None:
        hvd = self.group.hvd
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    def synchronize(self, optimizer) -> None:
        optimizer.synchronize()

    def allreduce_wait(self, synchronize_started: float) -> float:
        """Horovod starts the allreduce during backward and ``synchronize`` waits for the rest,
        so the wait is its duration."""
        return time.perf_counter() - synchronize_started

    def skip_synchronize(self, optimizer):
        return optimizer.skip_synchronize()


__all__ = ["HorovodDataParallel"]
