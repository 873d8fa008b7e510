"""torch DistributedDataParallel: every rank holds the whole model; DDP averages the gradients
in buckets during backward.

``accumulate`` turns DDP's allreduce off for all but the last micro-batch (``no_sync``), so
accumulation costs no extra communication, as with Horovod's ``backward_passes_per_step``. The
arithmetic equals Horovod's: DDP divides by the world size before the sum, Horovod after, and both
are exact for a power-of-two world size, so a checkpoint resumes on either backend.

torch is imported by the methods a rank runs (the driver imports this module for the declarations).
"""

from __future__ import annotations

import time

from training.strategies.base import Strategy, initialise_optimizer_state


class DistributedDataParallel(Strategy):
    name, key, ranks = "ddp", "train.parallel", ("torch",)

    def __init__(self, group, precision, config=None):
        super().__init__(group, precision, config)
        self._last_bucket_started: float | None = None  # set by the communication hook

    def wrap(self, model):
        from torch.nn.parallel import DistributedDataParallel as DDP

        # broadcast_buffers=False: a BatchNorm's running statistics stay each rank's own, as with
        # Horovod (DDP's default sends rank 0's to every rank at every forward).
        ddp = DDP(model, device_ids=[self.device] if self.device.type == "cuda" else None, broadcast_buffers=False)
        ddp.register_comm_hook(self, _timed_allreduce)
        return ddp

    def accumulate(self, step_model, sync: bool):
        return super().accumulate(step_model, sync) if sync else step_model.no_sync()

    def allreduce_wait(self, synchronize_started: float) -> float:
        """DDP waits inside backward, so timing ``synchronize`` reads 0: instead, the time from
        the start of the step's last bucket allreduce (all gradients computed by then) to the end
        of backward (``synchronize_started``), i.e. the communication still in flight when compute
        ran out."""
        started, self._last_bucket_started = self._last_bucket_started, None
        return max(0.0, synchronize_started - started) if started is not None else 0.0

    def broadcast_initial_state(self, model, optimizer) -> None:
        """Rank 0's tensors and optimizer state on every rank. A fresh optimizer first gets its
        state by one step on zero gradients, exactly as Horovod's ``broadcast_optimizer_state``
        does, so both backends start from the same state and train to identical weights."""
        import torch

        group = self.group
        with torch.no_grad():
            for tensor in model.state_dict().values():
                group.dist.broadcast(tensor, src=0)
        if not optimizer.state_dict()["state"]:
            initialise_optimizer_state(optimizer)
        state = group.broadcast_object(optimizer.state_dict() if group.rank == 0 else None)
        if group.rank:
            optimizer.load_state_dict(state)


def _timed_allreduce(strategy: DistributedDataParallel, bucket):
    """DDP's own allreduce (each rank's gradients divided by the world size, then summed), noting
    when each bucket starts it; the last one of a backward starts once every gradient is computed."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    strategy._last_bucket_started = time.perf_counter()
    return allreduce_hook(None, bucket)


__all__ = ["DistributedDataParallel"]
