"""Real torch.distributed ranks for tests, without Spark: ``run_ranks(world, fn, *args)`` starts
``world`` processes on 127.0.0.1 (torchrun's environment: RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), each builds the project's own ``TorchGroup`` (Gloo, CPU) and calls ``fn(group, *args)``
(a module-level function, so the process can import it); returns each rank's return value, in rank order.

A rank that raises fails the call with every failed rank's traceback; ranks still running at the
deadline are killed by their pids and named.

``RankPool(world)`` keeps ``world`` such ranks for the whole test session (the ``two_ranks``
fixture, tests/training/conftest.py): test files whose calls need 2 ranks but not a launch of their
own run them on the same processes instead of each paying for starting them and importing torch.

The rank processes are forked by multiprocessing's fork server, which imports torch and the rank loop
once (``PRELOAD``) in the test process's first call, instead of being spawned as fresh interpreters
that each import them: about 2 CPU s per rank process spawned, 0.1 s forked. What a rank inherits is
modules, not state: it builds its own group and seeds its own model and data, as before. Its
environment is the fork server's (the test process's when it started) with ``_rank_group``'s on top.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback

import torch.multiprocessing as mp

# Imported once by the fork server: torch, torch._dynamo (which a rank's first optimizer step
# imports), the rank loop and this module (where a rank process starts).
PRELOAD = ["torch", "torch._dynamo", "training.loop", "training.distributed", "torch_ranks"]


def _context():
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def run_ranks(world: int, fn, *args, timeout: float = 180) -> list:
    port = _free_port()
    context = _context()
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_group(rank: int, world: int, port: int):
    """This rank process as rank ``rank`` of ``world``: torchrun's environment, one torch thread,
    the project's own ``TorchGroup`` (Gloo, CPU)."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "OMP_NUM_THREADS": "1",
                       # a rank that failed is noticed by the others in a minute, not Gloo's default 10
                       "SHARDTRAIN_COLLECTIVE_TIMEOUT": "60"})
    import torch

    from training.distributed import TorchGroup

    torch.set_num_threads(1)
    return TorchGroup(torch.device("cpu"), "test rank")


def _rank_main(rank: int, world: int, port: int, out: str, fn, args) -> None:
    group = None
    try:
        group = _rank_group(rank, world, port)
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
    return _by_call(run_ranks(world, _each_call, list(calls), timeout=timeout))


def _by_call(per_rank: list[list]) -> list[list]:
    """Each rank's outcomes of a batch of calls (rank order), regrouped per call."""
    return [list(outcomes) for outcomes in zip(*per_rank)]


class RankPool:
    """``world`` ranks started at the first ``run_calls`` and kept: each ``run_calls(calls)`` runs
    ``calls`` one after another on the same group, as the module-level ``run_calls`` does in a
    launch of its own, and returns the same outcomes. Calls from different test files share the
    processes, so a call must not rely on a fresh process (every rank function here seeds its own
    model and data). A batch in which a call failed on any rank, or that ran past its timeout, ends
    the ranks (its group may be broken: a peer can be left inside a collective); the next batch
    starts fresh ones."""

    def __init__(self, world: int):
        self.world = world
        self._processes: list = []
        self._conns: list = []

    def run_calls(self, calls: list, timeout: float = 300) -> list[list]:
        if not self._processes:
            self._start()
        payload = pickle.dumps(list(calls))
        for conn in self._conns:
            conn.send_bytes(payload)
        deadline = time.monotonic() + timeout
        per_rank, failures = [], []
        for rank, conn in enumerate(self._conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                failures.append(f"rank {rank}: still running after {timeout}s, killed")
                continue
            try:
                per_rank.append(pickle.loads(conn.recv_bytes()))
            except EOFError:
                self._processes[rank].join(5)
                failures.append(f"rank {rank}: no result (exit code {self._processes[rank].exitcode})")
        if failures:
            self.close(wait=0)
            raise AssertionError("\n".join(failures))
        outcomes = _by_call(per_rank)
        if not all(ok for outcome in outcomes for ok, _ in outcome):
            self.close()
        return outcomes

    def _start(self) -> None:
        port = _free_port()
        context = _context()
        pipes = [context.Pipe() for _ in range(self.world)]
        self._processes = [context.Process(target=_pool_rank_main, args=(rank, self.world, port, child))
                           for rank, (_, child) in enumerate(pipes)]
        for process in self._processes:
            process.start()
        for _, child in pipes:
            child.close()  # the rank's end: an EOF here then means the rank process is gone
        self._conns = [parent for parent, _ in pipes]

    def close(self, wait: float = 30) -> None:
        """Ask the ranks to leave their group and exit; kill any still there after ``wait`` s."""
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(None))
            except OSError:
                pass
        deadline = time.monotonic() + wait
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        for conn in self._conns:
            conn.close()
        self._processes, self._conns = [], []


def _pool_rank_main(rank: int, world: int, port: int, conn) -> None:
    group = None
    try:
        group = _rank_group(rank, world, port)
        while True:  # a test process that died closes its end: EOFError, and this rank exits too
            calls = pickle.loads(conn.recv_bytes())
            if calls is None:
                break
            conn.send_bytes(pickle.dumps(_each_call(group, calls)))
    finally:
        if group is not None:
            group.shutdown()


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


def run_loop(cfg, pool: RankPool | None = None):
    """A whole run of ``cfg`` (``launch.backend=torch``) through the rank loop
    (``training.loop.run_rank``) on ``launch.num_proc`` bare Gloo ranks: no Spark job, no launcher,
    rank 0 checkpoints and publishes to ``output.model_path`` as a launched rank 0 would. An
    uninterrupted reference for a failure test, at the cost of two rank processes: the launcher
    adds nothing to the arithmetic (test_torchrun's test_torchrun_trains_bit_identically_to_torch_distributor,
    test_torch_backend's test_horovod_and_torch_train_identically). ``pool``: run it on those ranks
    (a ``RankPool`` of ``launch.num_proc``) instead of starting two. Returns rank 0's view as
    ``train()``'s result names it: steps_per_rank, steps_per_epoch, metrics, model_uri."""
    from types import SimpleNamespace

    from training.plan import build_plan

    calls = [(_run_rank, (build_plan(cfg),))]
    if pool is not None:
        assert pool.world == cfg.launch.num_proc, (pool.world, cfg.launch.num_proc)
    results = values((pool.run_calls(calls) if pool is not None else run_calls(cfg.launch.num_proc, calls))[0])
    return SimpleNamespace(steps_per_rank=[r["steps"] for r in results], steps_per_epoch=results[0]["steps_per_epoch"],
                           metrics=results[0]["metrics"], model_uri=cfg.output.model_path)


def _run_rank(group, plan) -> dict:
    from training.loop import run_rank

    return run_rank(plan, group)
