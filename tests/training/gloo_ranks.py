"""Real torch.distributed ranks for strategy tests: ``run_ranks(fn, world, *args)`` starts
``world`` spawned processes on one Gloo group over 127.0.0.1, runs ``fn(group, *args)`` in each
(``group``: a real ``training.distributed.TorchGroup``) and returns their results, rank order.
A rank that raises fails the call with its traceback. Seconds per run, no Spark."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import traceback

from spark_cluster import free_port


def _rank(fn, rank: int, world: int, port: int, args, queue) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"})
    try:
        import torch

        torch.set_num_threads(1)
        from training.distributed import TorchGroup

        group = TorchGroup()
        try:
            # Pickled here: torch's own queue pickling shares tensors by file descriptor, gone with the process.
            queue.put((rank, True, pickle.dumps(fn(group, *args))))
        finally:
            group.shutdown()
    except BaseException:  # noqa: BLE001 - sent to the test, which fails with it
        queue.put((rank, False, traceback.format_exc()))


def run_ranks(fn, world: int, *args, timeout: float = 120) -> list:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    procs = [context.Process(target=_rank, args=(fn, rank, world, port, args, queue), daemon=True)
             for rank in range(world)]
    for proc in procs:
        proc.start()
    results = {}
    try:
        for _ in range(world):
            rank, ok, value = queue.get(timeout=timeout)
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return [results[rank] for rank in range(world)]
