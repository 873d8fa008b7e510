"""torch.distributed ranks run inside the Spark barrier tasks themselves (``launch.backend=torch_tasks``):
one barrier task per rank, and each task's own Python worker is the rank. No torchrun, no process
started per rank: a rank costs what its training costs, and Spark's Python worker reuse keeps torch
imported for the next launch of the session (a sweep's trials, a notebook's re-runs, restarts).

The same ranks as the ``torch`` backend (TorchDistributor): the same rank loop, strategies (DDP, FSDP2,
pipeline stages, periodic sync), Gloo on CPU / NCCL on the task's Spark GPU, and the same weights bit
for bit. What differs is only how the ranks start and hand back their records:

- one ``spark.range(n, numPartitions=n).mapInPandas(..., barrier=True)`` job, on classic Spark and
  Spark Connect alike, submitted on the calling thread (so ``common.spark.LaunchJobs``' job tag marks it);
- rank = the task's partition id; rank 0 hosts the group's TCPStore (a fresh one per launch, on a
  port the OS picks) and the others learn its address through ``BarrierTaskContext.allGather``;
- every task returns its own rank's record through Spark (no store exchange, as TorchDistributor needs).

A Python worker outlives its task, so a rank leaves it as it found it: the environment variables and
``sys.path`` entries the launch set are undone, the plug-in modules imported from them forgotten, the
process group destroyed (also one whose start failed half-way), and the run's memory released
(garbage collected; on a GPU, torch's cached blocks emptied). What stays is what a reused worker
keeps anyway: the other imported modules, and on a GPU the CUDA context (until Spark stops the idle
worker, about a minute later). TorchDistributor's tasks leave ``CUDA_VISIBLE_DEVICES`` and
``NODE_RANK`` in the workers they ran in; a rank here ignores them. Where GPU memory must be free the moment a run ends,
use ``launch.backend=torch``, whose ranks are processes of their own.

A rank's process dying (SIGKILL, out of memory) kills its Python worker: Spark fails the barrier
stage, which ends the other tasks, and the driver's supervisor relaunches as for any lost rank. A
rank that fails but lives on shuts its group's TCP connections, so that ranks waiting on it in a Gloo
collective fail at once (over NCCL's own transports they wait for NCCL's timeout or the stall rule).

``launch.start_timeout`` bounds the ranks' rendezvous in rank 0's store (the driver's supervisor
bounds the wait for task slots, as for every Spark launcher).

Rank side imports only ``common`` and the standard library at import time; torch when a rank runs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import pickle
import sys

from common.errors import LaunchError
from training.launchers.base import SparkLauncher
from training.launchers.capacity import barrier_slots_error, check_capacity
from training.launchers.rank_entry import run_rank_entry

log = logging.getLogger("shardtrain.train")

_SCHEMA = "rank int, record binary"


def launch_torch_tasks(plan, spark, launch_cfg) -> list[dict]:
    """``launch_cfg.num_proc`` ranks as one barrier Spark job of ``spark``'s application; one record
    per rank, rank 0 first (``training.launchers.rank_entry``), or a ``LaunchError``."""
    check_capacity(spark, launch_cfg.num_proc, launch_cfg.gpus_per_proc)
    n = launch_cfg.num_proc
    env = {str(k): str(v) for k, v in launch_cfg.env.items()}
    task = functools.partial(rank_task, plan, env, launch_cfg.start_timeout)
    try:
        rows = spark.range(0, n, 1, n).mapInPandas(task, _SCHEMA, barrier=True).collect()
    except Exception as exc:  # noqa: BLE001 - mapped to one typed error with the cause in words
        from common.spark import executor_setup_error, explain_java_error

        setup = executor_setup_error(exc, f"the {n} rank task(s)")
        if setup is not None:
            raise setup from None
        text = explain_java_error(exc)
        slots = barrier_slots_error(text, "launch.backend=torch_tasks", n)
        if slots:
            raise slots from exc
        # A rank's process that died (killed, out of memory) fails the barrier stage, and with it the job;
        # Spark reads the worker's closed socket as an EOFException, or says it crashed.
        died = any(sign in text for sign in ("EOFException", "worker exited unexpectedly", "crashed"))
        cause = "a rank's Python worker died (killed, or out of memory): " if died else ""
        raise LaunchError(f"the {n} rank task(s) failed: {cause}{text}; the ranks' own output above says more",
                          rank_lost=True) from exc
    records = {row["rank"]: pickle.loads(row["record"]) for row in rows}
    if sorted(records) != list(range(n)):
        raise LaunchError(f"the barrier job returned records of ranks {sorted(records)} instead of 0..{n - 1}")
    return [records[rank] for rank in range(n)]


def rank_task(plan, env: dict, start_timeout: int, batches):
    """One rank, in its barrier task's Python worker (``mapInPandas``: ``batches`` is the task's one
    input row). Yields one row: the rank and its pickled record. Never raises past the record."""
    import pandas as pd
    from pyspark import BarrierTaskContext

    for _ in batches:
        pass
    ctx = BarrierTaskContext.get()
    rank, infos = ctx.partitionId(), ctx.getTaskInfos()
    host = infos[0].address.rsplit(":", 1)[0]  # rank 0's executor
    # Every task reaches this one allGather, whatever fails later: a task that left before it would
    # leave the others waiting in it. Rank 0's store lives until its task ends, after its group.
    server, said = _host_store(rank, len(infos), start_timeout)
    port = next(p for p in ctx.allGather(said) if p)
    with _rank_environment({**env, "RANK": str(rank), "WORLD_SIZE": str(len(infos)), "MASTER_ADDR": host,
                            "MASTER_PORT": port}):
        opened = _OpenedSockets({info.address.rsplit(":", 1)[0] for info in infos})
        start = functools.partial(_start_group, opened=opened,
                                  store=lambda: server or _join_store(host, port, len(infos), start_timeout))
        record = run_rank_entry(plan, rank, start, functools.partial(_train, opened=opened),
                                stop_group=lambda group: group.shutdown())
    _leave_stale_group()  # a group whose start failed half-way (no group came back to stop)
    del server
    _release_memory()
    yield pd.DataFrame({"rank": [rank], "record": [pickle.dumps(record)]})


def _release_memory() -> None:
    """The run's tensors back to the system before the worker idles: Python's garbage, and on a GPU
    the blocks torch's caching allocator still holds (the CUDA context itself stays with the worker)."""
    import gc

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _host_store(rank: int, world: int, timeout_s: int):
    """Rank 0: (the launch's TCPStore on a port the OS picks, its port as text); other ranks (None, "").
    A store that cannot start says so in the text the others receive."""
    if rank != 0:
        return None, ""
    try:
        import datetime

        import torch.distributed as dist

        server = dist.TCPStore("0.0.0.0", 0, world, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                               wait_for_workers=False)
        return server, str(server.port)
    except Exception as exc:  # noqa: BLE001 - rank 0 raises it again in its own start (run_rank_entry's record)
        return None, f"error: {type(exc).__name__}: {exc}"


def _join_store(host: str, port: str, world: int, timeout_s: int):
    import datetime

    import torch.distributed as dist

    if not port.isdigit():
        raise RuntimeError(f"rank 0 could not start the launch's TCPStore ({port})")
    return dist.TCPStore(host, int(port), world, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def _start_group(plan, store, opened: "_OpenedSockets"):
    from training.distributed import TorchGroup, pick_device

    opened.mark()  # after the rank's report connection, before the store's and the group's
    try:
        device = pick_device(int(os.environ["RANK"]))
        return TorchGroup(*device, store=store())
    except BaseException:
        opened.shut_down()  # the peers waiting in the group's start learn now
        raise


def _leave_stale_group() -> None:
    """Destroy a default process group this worker still holds (the rank's group start failed
    half-way, or its stop did): torch would refuse to start the next rank's group in the process."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - the next init says what is wrong, if anything is
            log.warning("a process group left in this worker could not be destroyed: %s", exc)


def _train(plan, group, reporter, opened: "_OpenedSockets") -> dict:
    from training.loop import run_rank

    try:
        return run_rank(plan, group, hooks=reporter)
    except BaseException:
        # A failed rank's process lives on (its worker is Spark's), and Gloo keeps its connections
        # open while a collective it started is pending (destroying or aborting the group does not
        # close them): the other ranks, waiting on this one, would learn of the failure only when
        # Spark stops the idle worker, a minute later. Shutting the group's sockets tells them now.
        opened.shut_down()
        raise


class _OpenedSockets:
    """The TCP connections to the ranks' hosts this process opened since ``mark()`` (the group's and
    the store's), read from ``/proc/self/fd`` (Linux, where Spark's executors run; elsewhere none are
    found). Other sockets a rank may open meanwhile (an event loop's socket pair, a storage client's
    connections to other hosts) are left alone."""

    def __init__(self, hosts: set[str]):
        self.before: set[int] | None = None
        self.peers = _addresses(hosts)

    def mark(self) -> None:
        self.before = _socket_fds()

    def shut_down(self) -> None:
        """Shut both directions of each such connected socket (the peer reads end of stream); the
        descriptors stay open for their owners (Gloo, the store) to close."""
        import socket

        if self.before is None:
            return  # the group never began to start
        for fd in sorted(_socket_fds() - self.before):
            try:
                sock = socket.socket(fileno=fd)
            except OSError:
                continue
            try:
                # Connected (a listening socket is left alone: Gloo's loop would fail on it), over TCP,
                # to one of the ranks' hosts.
                if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM and \
                        _plain(sock.getpeername()[0]) in self.peers:
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # a listening socket, or one already closed
            finally:
                sock.detach()


def _addresses(hosts: set[str]) -> set[str]:
    """The IP addresses of ``hosts`` (names or addresses), IPv4-mapped IPv6 written as IPv4."""
    import socket

    found = set()
    for host in hosts:
        try:
            found.update(_plain(info[4][0]) for info in socket.getaddrinfo(host, None))
        except OSError:
            found.add(_plain(host))
    return found


def _plain(address: str) -> str:
    return address[7:] if address.startswith("::ffff:") else address


def _socket_fds() -> set[int]:
    fds = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return fds
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                fds.add(int(name))
        except OSError:
            pass  # closed meanwhile (the listing's own descriptor among them)
    return fds


# What pyspark's TorchDistributor sets in the worker that runs its task and never unsets (NODE_RANK is
# its mark): CUDA_VISIBLE_DEVICES is "" after a CPU launch, which would hide the GPUs from a rank here.
_TORCH_DISTRIBUTOR_LEFTOVERS = ("NODE_RANK", "CUDA_VISIBLE_DEVICES")


@contextlib.contextmanager
def _rank_environment(env: dict):
    """``env`` in ``os.environ`` (and its PYTHONPATH entries in ``sys.path``: plug-in models) for the
    rank, then as they were: the worker runs other tasks after this one. Only what changed is put
    back (threads the rank leaves, such as a reader's, may still read the environment), and the
    modules imported from the added paths are forgotten, so that the next launch imports the plug-in
    as it is then (a notebook's edited model), not as this one found it."""
    saved_env, saved_path, saved_modules = dict(os.environ), list(sys.path), set(sys.modules)
    if "NODE_RANK" in os.environ:
        for name in _TORCH_DISTRIBUTOR_LEFTOVERS:
            os.environ.pop(name, None)
    os.environ.update(env)
    added = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[:0] = added
    try:
        yield
    finally:
        for name in [k for k in os.environ if k not in saved_env]:
            os.environ.pop(name, None)
        for name, value in saved_env.items():
            if os.environ.get(name) != value:
                os.environ[name] = value
        sys.path[:] = saved_path
        _forget_modules(set(sys.modules) - saved_modules, added)


def _forget_modules(names: set[str], paths: list[str]) -> None:
    roots = [os.path.join(os.path.abspath(p), "") for p in paths]
    for name in names:
        origin = getattr(sys.modules.get(name), "__file__", None) or ""
        if roots and any(os.path.abspath(origin).startswith(root) for root in roots):
            sys.modules.pop(name, None)
    if roots:
        import importlib

        importlib.invalidate_caches()


class TorchTasksLauncher(SparkLauncher):
    """``launch.backend=torch_tasks``: torch.distributed ranks in the barrier tasks' own workers."""

    def launch_ranks(self, plan, spark, launch_cfg) -> list[dict]:
        return launch_torch_tasks(plan, spark, launch_cfg)


__all__ = ["TorchTasksLauncher", "launch_torch_tasks", "rank_task"]
