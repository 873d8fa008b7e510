"""Kill a rank that stopped itself: the tests' one way to SIGKILL a rank process at a known point
(``common.faults``: ``<where>:<step>:stop`` with ``SHARDTRAIN_FAULT_ONCE``, the rank writing its pid
to the once-file before it stops)."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Callable

from polling import wait_for


@contextlib.contextmanager
def stopped_rank_killed(once, describe: Callable, what: str = "rank 0", timeout: float = 240):
    """While the block runs a launch whose rank stops itself once: wait for its pid in ``once``,
    prove the process stopped, record ``describe(proc)`` (a dict: what the test checks about it
    before the kill), SIGKILL it and prove it dead. Yields what was seen: ``describe``'s keys, and
    ``dead``, or ``error`` where something did not happen."""
    import psutil

    seen, ended = {}, threading.Event()

    def saboteur():
        try:
            pid = int(wait_for(lambda: once.exists() and once.read_text(), f"{what} to stop", timeout=timeout,
                               abort=ended))
            proc = psutil.Process(pid)
            wait_for(lambda: proc.status() == psutil.STATUS_STOPPED, f"{what} to be stopped", timeout=30, abort=ended)
            seen.update(describe(proc))
            proc.send_signal(signal.SIGKILL)
            wait_for(lambda: not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE, f"{what} to die",
                     timeout=60, abort=ended)
            seen["proc"], seen["dead"] = proc, True
        except Exception as exc:  # noqa: BLE001 - reported by the test
            seen["error"] = exc

    thread = threading.Thread(target=saboteur, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        ended.set()
        thread.join()
