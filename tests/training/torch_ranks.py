"""Real torch.distributed ranks for tests, without Spark: ``run_ranks(world, fn, *args)`` starts
``world`` spawned processes on 127.0.0.1 (torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), each builds the project's own ``TorchGroup`` (Gloo, CPU) and calls ``fn(group, *args)``
(a module-level function, so spawn can import it); returns each rank's return value, in rank order.

A rank that raises fails the call with every failed rank's traceback; ranks still running at the
deadline are killed by their pids and named.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback

import torch.multiprocessing as mp


def run_ranks(world: int, fn, *args, timeout: float = 180) -> list:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out:
        processes = [context.Process(target=_rank_main, args=(rank, world, port, out, fn, args)) for rank in range(world)]
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
        results, failures = [], []
        for rank in range(world):
            path = os.path.join(out, f"rank-{rank}.pkl")
            if not os.path.exists(path):
                failures.append(f"rank {rank}: no result (exit code {processes[rank].exitcode})")
                results.append(None)
                continue
            with open(path, "rb") as fh:
                ok, value = pickle.load(fh)
            if not ok:
                failures.append(f"rank {rank}:\n{value}")
            results.append(value)
    if hung:
        failures.insert(0, f"ranks {hung} still running after {timeout}s, killed")
    assert not failures, "\n".join(failures)
    return results


def _rank_main(rank: int, world: int, port: int, out: str, fn, args) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1",
                       # a rank that failed is noticed by the others in a minute, not Gloo's default 10
                       "SHARDTRAIN_COLLECTIVE_TIMEOUT": "60"})
    import torch

    from training.distributed import TorchGroup

    torch.set_num_threads(1)
    group = None
    try:
        group = TorchGroup(torch.device("cpu"), "test rank")
        result = (True, fn(group, *args))
    except BaseException:  # noqa: BLE001 - the test reports it with the rank's traceback
        result = (False, traceback.format_exc())
    finally:
        if group is not None:
            group.shutdown()
    with open(os.path.join(out, f"rank-{rank}.pkl"), "wb") as fh:
        pickle.dump(result, fh)


def run_calls(world: int, calls: list, timeout: float = 300) -> list[list]:
    """Several rank functions in ONE launch of ``world`` ranks, one after another on the same group:
    ``calls`` is a list of ``(fn, args)``. Spawning the ranks and importing torch is most of a
    small call's seconds, so the tests that each read one small call share the launch. Returns,
    per call, every rank's ``(True, value)`` or ``(False, traceback)`` in rank order: a call that
    raises is reported to the test that reads it (see ``values``), not to all of them."""
    per_rank = run_ranks(world, _each_call, list(calls), timeout=timeout)
    return [[per_rank[rank][i] for rank in range(world)] for i in range(len(calls))]


def values(outcomes: list) -> list:
    """Each rank's return value of one call of ``run_calls``; fails with every failed rank's traceback."""
    failed = [f"rank {rank}:\n{value}" for rank, (ok, value) in enumerate(outcomes) if not ok]
    assert not failed, "\n".join(failed)
    return [value for _, value in outcomes]


def _each_call(group, calls: list) -> list:
    outcomes = []
    for fn, args in calls:
        try:
            outcomes.append((True, fn(group, *args)))
        except Exception:  # noqa: BLE001 - reported to the test that reads this call
            outcomes.append((False, traceback.format_exc()))
    return outcomes


def run_loop(cfg):
    """A whole run of ``cfg`` (``launch.backend=torch``) through the rank loop
    (``training.loop.run_rank``) on ``launch.num_proc`` bare Gloo ranks: no Spark job, no launcher,
    rank 0 checkpoints and publishes to ``output.model_path`` as a launched rank 0 would. An
    uninterrupted reference for a failure test, at the cost of two spawned processes: the launcher
    adds nothing to the arithmetic (test_torchrun's test_torchrun_trains_bit_identically_to_torch_distributor,
    test_torch_backend's test_horovod_and_torch_train_identically). Returns rank 0's view as
    ``train()``'s result names it: steps_per_rank, steps_per_epoch, metrics, model_uri."""
    from types import SimpleNamespace

    from training.plan import build_plan

    results = values(run_calls(cfg.launch.num_proc, [(_run_rank, (build_plan(cfg),))])[0])
    return SimpleNamespace(steps_per_rank=[r["steps"] for r in results], steps_per_epoch=results[0]["steps_per_epoch"],
                           metrics=results[0]["metrics"], model_uri=cfg.output.model_path)


def _run_rank(group, plan) -> dict:
    from training.loop import run_rank

    return run_rank(plan, group)
