"""Where a rank's host time goes besides computing: ``StepTimer`` (data wait, allreduce wait),
read into each epoch's record and the step log."""

from __future__ import annotations

import time


class StepTimer:
    """Host wall time the loop spends blocked in the loader's ``next()`` and waiting for the part
    of the gradient allreduce that backward did not hide (``group.allreduce_wait``: Horovod's
    ``optimizer.synchronize()``; under DDP, the wait inside backward after its last bucket started).

    Only ``time.perf_counter`` around host calls: no CUDA event or synchronize is added. On a
    GPU the host runs ahead of the device, so ``data_wait_seconds`` is time the host could not
    queue work; when it is small the GPU was never starved by the loader.
    """

    def __init__(self):
        self.data_wait_seconds = 0.0
        self.allreduce_wait_seconds = 0.0

    def timed(self, iterable):
        iterator = iter(iterable)
        try:
            while True:
                started = time.perf_counter()
                try:
                    item = next(iterator)
                except StopIteration:
                    return
                finally:
                    self.data_wait_seconds += time.perf_counter() - started
                yield item
        finally:
            close = getattr(iterator, "close", None)
            if close:
                close()  # stops the loader's reader now, as iterating the loader directly would

    def snapshot(self) -> tuple[float, float]:
        return self.data_wait_seconds, self.allreduce_wait_seconds

    def since(self, snapshot: tuple[float, float]) -> dict:
        return {"data_wait_seconds": round(self.data_wait_seconds - snapshot[0], 4),
                "allreduce_wait_seconds": round(self.allreduce_wait_seconds - snapshot[1], 4)}


__all__ = ["StepTimer"]
