"""Rank groups: who the ranks of one training run are, which device this one computes on, and the
few collectives the rank loop needs (broadcast, gather, sum, min). How a model is trained in
parallel is not decided here: that is the strategy's (``training.strategies``).

``LocalGroup`` (world size 1) serves the in-process mode, notebooks and GPU benchmarks,
``HorovodGroup`` the Horovod ranks, ``TorchGroup`` the torch.distributed ranks (TorchDistributor's,
torchrun's, or those run inside Spark's barrier tasks). Every group is built with the device
resolved once for the rank (``in_process_device``, ``pick_device`` for a Spark rank).
``average_`` and ``broadcast_`` work in place on one tensor, and ``average_`` can run in the
background (a ``Pending`` to wait on): what strategies that move whole parameter vectors need.

Rank-side only (imports torch).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import sys
import time

import torch

from common.devices import resolve_device
from common.errors import ConfigError, LaunchError, first_line

log = logging.getLogger("shardtrain.train")

_CPU = torch.device("cpu")
_POLL_SECONDS = 0.1  # the rendezvous' polls: how late a rank learns that all have arrived


class LocalGroup:
    rank, size, local_rank, local_size = 0, 1, 0, 1

    def __init__(self, device: torch.device = _CPU, device_reason: str = "one process"):
        self.device, self.device_reason = device, device_reason

    def broadcast_object(self, obj):
        return obj

    def allgather_object(self, obj) -> list:
        return [obj]

    def allreduce_sum(self, tensor):
        return tensor

    def allreduce_min(self, tensor):
        return tensor

    def average_(self, tensor, background: bool = False) -> "Pending":
        return Pending(lambda: None)

    def broadcast_(self, tensor) -> None:
        pass

    def shutdown(self) -> None:
        pass


class HorovodGroup:
    def __init__(self, device: torch.device = _CPU, device_reason: str = ""):
        import horovod.torch as hvd

        hvd.init()
        self.hvd = hvd
        self.device, self.device_reason = device, device_reason
        self.refresh()

    def refresh(self) -> None:
        """Read rank and size again: Horovod elastic renumbers the ranks after one left."""
        hvd = self.hvd
        self.rank, self.size = hvd.rank(), hvd.size()
        self.local_rank, self.local_size = hvd.local_rank(), hvd.local_size()

    def broadcast_object(self, obj):
        return self.hvd.broadcast_object(obj, root_rank=0)

    def allgather_object(self, obj) -> list:
        return self.hvd.allgather_object(obj)

    def allreduce_sum(self, tensor):
        return self.hvd.allreduce(tensor, op=self.hvd.Sum)

    def allreduce_min(self, tensor):
        return self.hvd.allreduce(tensor, op=self.hvd.Min)

    def average_(self, tensor, background: bool = False) -> "Pending":
        handle = self.hvd.allreduce_async_(tensor, op=self.hvd.Average)
        pending = Pending(lambda: self.hvd.synchronize(handle))
        if not background:
            pending.wait()
        return pending

    def broadcast_(self, tensor) -> None:
        self.hvd.broadcast_(tensor, root_rank=0)

    def shutdown(self) -> None:
        self.hvd.shutdown()


def attempt_store(timeout: datetime.timedelta):
    """The store this attempt's group meets in, where torchrun's agent hosts it: its TCPStore
    under a prefix per launch and restart (``shardtrain/<TORCHELASTIC_RUN_ID>/attempt_<TORCHELASTIC_RESTART_COUNT>``);
    None elsewhere (``init_process_group``'s own ``env://``).

    torchrun's agent (c10d rendezvous, TCPStore sharing on by default since torch 2.5) keeps the
    same store, on the same port, across ``--max-restarts`` restarts, and ``env://`` gives the
    workers no per-attempt prefix: a restarted rank's Gloo rendezvous could read the dead
    attempt's addresses and fail with "connectFullMesh ... Connection refused" (pytorch issue
    135712). The restart count is the same on every rank of one agent; on several nodes an agent
    that restarts for a membership change keeps its count, so there set
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (a fresh store per attempt; this returns None)."""
    if not _agent_hosts_store():
        return None
    import torch.distributed as dist

    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return _per_attempt(base)


def _agent_hosts_store() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def _per_attempt(base):
    import torch.distributed as dist

    return dist.PrefixStore(f"shardtrain/{attempt_key()}", base)


def attempt_key() -> str:
    """``<TORCHELASTIC_RUN_ID>/attempt_<TORCHELASTIC_RESTART_COUNT>``: one launch's one attempt."""
    return (f"{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}/"
            f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0') or '0'}")


# --- the rendezvous of ranks started from outside (torchrun, or a launcher that sets its environment) ---

def rendezvous_store(rank: int, world: int, master_addr: str, master_port: int, start_timeout: int):
    """The store this attempt's ``world`` ranks meet in at ``master_addr:master_port`` (torchrun's
    agent's, or else the one rank 0 hosts there, as ``env://`` does), once all of them have
    arrived in it. Within ``start_timeout`` seconds (``launch.start_timeout``), or one line
    saying what did not come: MASTER_ADDR not resolving (ConfigError, exit 2: the address given
    is wrong), nothing answering there, or which ranks never arrived (LaunchError, exit 1: a rank
    or host that may come on a retry). Without this the wait was the collective timeout's (10
    minutes), silent, ending in a C++ traceback that named no rank. From then on the store waits
    as long as the collectives do (``SHARDTRAIN_COLLECTIVE_TIMEOUT``)."""
    import torch.distributed as dist

    deadline = time.monotonic() + start_timeout
    where = f"MASTER_ADDR:MASTER_PORT={master_addr}:{master_port} within launch.start_timeout={start_timeout}s"
    _resolve(master_addr, deadline, start_timeout)
    hosts = rank == 0 and not _agent_hosts_store()
    if not hosts:
        _wait_for_answer(rank, master_addr, master_port, deadline, where)
    try:
        base = dist.TCPStore(master_addr, master_port, world, is_master=hosts, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=max(1.0, deadline - time.monotonic())))
    except Exception as exc:  # noqa: BLE001 - torch's DistNetworkError, as one line naming the address
        doing = f"cannot host the rendezvous on MASTER_PORT={master_port}" if hosts else f"cannot join {where}"
        raise LaunchError(f"rank {rank} {doing}: {first_line(exc)}") from None
    store = _per_attempt(base)
    _wait_for_ranks(store, rank, world, deadline, where)
    base.set_timeout(datetime.timedelta(seconds=_collective_timeout()))
    return store


def _resolve(master_addr: str, deadline: float, start_timeout: int) -> None:
    """MASTER_ADDR resolves, tried until ``deadline``: a new host's or service's DNS record (a
    Kubernetes pod's) can appear after the ranks start. One that never does is the address given
    (exit 2)."""
    while True:
        try:
            socket.getaddrinfo(master_addr, None)
            return
        except socket.gaierror as exc:
            if time.monotonic() >= deadline:
                raise ConfigError(f"MASTER_ADDR={master_addr} does not resolve to an address ({exc.strerror}; tried "
                                  f"for launch.start_timeout={start_timeout}s): set MASTER_ADDR to rank 0's host name "
                                  "or IP address") from None
        time.sleep(1.0)  # a name server is asked once a second, not ten times


def _wait_for_answer(rank: int, master_addr: str, master_port: int, deadline: float, where: str) -> None:
    """Something answers at the store's address, tried until ``deadline``. Asked here, not by the
    store's own client, whose every failed try prints C++ frames."""
    while True:
        try:
            with socket.create_connection((master_addr, master_port), timeout=max(0.1, deadline - time.monotonic())):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise LaunchError(f"rank {rank}: nothing answered at {where} ({exc.strerror or first_line(exc)}): rank "
                                  "0 hosts the rendezvous there; start it, or set MASTER_ADDR and MASTER_PORT to its "
                                  "host and port") from None
        time.sleep(_POLL_SECONDS)


def _wait_for_ranks(store, rank: int, world: int, deadline: float, where: str) -> None:
    """Every rank has checked in to ``store`` by ``deadline``: each adds itself to a count and
    leaves a key of its own, so that the ranks still missing can be named. Polled (a count is one
    request), not waited on: the store's timed-out wait prints C++ warnings."""
    store.set(f"arrived/{rank}", "1")
    arrived = store.add("arrived", 1)
    while arrived < world:
        if time.monotonic() >= deadline:
            missing = [r for r in range(world) if not store.check([f"arrived/{r}"])]
            raise LaunchError(f"rank(s) {_listed(missing)} of WORLD_SIZE={world} never arrived at the rendezvous at "
                              f"{where}: start every rank with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE (a "
                              "rank that failed before says why in its own output), or raise launch.start_timeout")
        time.sleep(_POLL_SECONDS)
        arrived = store.add("arrived", 0)


def _listed(ranks: list[int], most: int = 20) -> str:
    shown = ", ".join(map(str, ranks[:most]))
    return shown if len(ranks) <= most else f"{shown} and {len(ranks) - most} more"


class TorchGroup:
    """The ranks of one torch.distributed job (torchrun's environment: RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT): Gloo on CPU, NCCL on CUDA. ``store``: the store the group meets in,
    where the launcher made one (``launch.backend=torch_tasks``; ``torchrun``: ``rendezvous_store``);
    else the agent's of TorchDistributor's torchrun (``attempt_store``), or ``env://``'s."""

    def __init__(self, device: torch.device = _CPU, device_reason: str = "", store=None):
        import torch.distributed as dist

        self.dist = dist
        self.device, self.device_reason = device, device_reason
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=_collective_timeout())
        store = store if store is not None else attempt_store(timeout)
        if store is None:
            dist.init_process_group(self.backend, timeout=timeout)
        else:
            dist.init_process_group(self.backend, timeout=timeout, store=store, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]))
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        # TorchDistributor runs one torchrun per Spark task (LOCAL_WORLD_SIZE=1), but tasks can
        # share a machine: count the ranks per host, as Horovod does, so they share its cores.
        hosts = self.allgather_object(socket.gethostname())
        mine = hosts[self.rank]
        self.local_rank = hosts[:self.rank].count(mine)
        self.local_size = hosts.count(mine)

    def broadcast_object(self, obj):
        box = [obj]
        self.dist.broadcast_object_list(box, src=0, device=self._object_device())
        return box[0]

    def allgather_object(self, obj) -> list:
        out = [None] * self.size
        self.dist.all_gather_object(out, obj)
        return out

    def allreduce_sum(self, tensor):
        return self._allreduce(tensor, self.dist.ReduceOp.SUM)

    def allreduce_min(self, tensor):
        return self._allreduce(tensor, self.dist.ReduceOp.MIN)

    def average_(self, tensor, background: bool = False) -> "Pending":
        work = self.dist.all_reduce(tensor, op=self.dist.ReduceOp.SUM, async_op=True)

        def finish():
            work.wait()
            tensor.div_(self.size)

        pending = Pending(finish)
        if not background:
            pending.wait()
        return pending

    def broadcast_(self, tensor) -> None:
        self.dist.broadcast(tensor, src=0)

    def _allreduce(self, tensor, op):
        # Horovod returns a new tensor and leaves its input alone; so does this.
        out = tensor.detach().clone().to(self.device)
        self.dist.all_reduce(out, op=op)
        return out.to(tensor.device)

    def _object_device(self):
        return self.device if self.backend == "nccl" else None

    def shutdown(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


class Pending:
    """An in-place collective that may still be running (``average_(..., background=True)``);
    ``wait()`` returns once its result is in the tensor. Waiting twice is waiting once."""

    def __init__(self, finish):
        self._finish = finish

    def wait(self) -> None:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()


def in_process_device(launch_cfg) -> tuple[torch.device, str]:
    """(device, why) of the one rank in the driver's process: what ``launch.device`` asks for."""
    wanted = launch_cfg.device
    if wanted == "cpu":
        return _CPU, "in-process mode, launch.device=cpu"
    if torch.cuda.is_available():
        return torch.device("cuda:0"), "in-process mode, CUDA available"
    if wanted == "cuda":
        raise ConfigError("launch.device=cuda but CUDA is not available in this process "
                          "(no GPU, or a CPU build of torch); use launch.device=auto or cpu")
    return _CPU, "in-process mode, no CUDA"


def pick_device(rank: int) -> tuple[torch.device, str]:
    """(device, why) for this Spark rank, resolved once, before its group starts: the GPU Spark
    assigned to its task (else the CPU)."""
    addresses = spark_gpu_addresses()
    name, why = resolve_device(addresses, torch.cuda.is_available(), os.environ.get("CUDA_VISIBLE_DEVICES"))
    if addresses and name == "cpu":
        log.warning("rank %d: %s", rank, why)
    device = torch.device(name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device, why


def _collective_timeout() -> int:
    # A rank that stops without closing its connections is noticed after this long (Gloo's
    # default is 30 minutes); SHARDTRAIN_COLLECTIVE_TIMEOUT overrides it.
    return int(os.environ.get("SHARDTRAIN_COLLECTIVE_TIMEOUT", "600"))


def spark_gpu_addresses() -> list[str]:
    """The GPU addresses of the Spark task this rank was launched from."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # A torchrun rank under TorchDistributor, which sets CUDA_VISIBLE_DEVICES to the task's
        # Spark GPU addresses ("" when it runs with use_gpu=False).
        return [a.strip() for a in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if a.strip()]
    context = _spark_task_context()
    if context is not None:
        # A rank inside its Spark task's own Python worker (launch.backend=torch_tasks).
        gpu = context.resources().get("gpu")
        return [str(a) for a in gpu.addresses] if gpu else []
    # A Horovod-on-Spark rank: horovod.spark.task set its task's resources before running the rank's
    # function. Not imported means no such task gave this process any (importing it here would only
    # cost an in-process run a pyspark import for the same empty answer).
    task_info = sys.modules.get("horovod.spark.task.task_info")
    return [] if task_info is None else [str(a) for a in task_info.get_available_devices()]


def _spark_task_context():
    """The Spark task this process runs now, if it is a Spark Python worker (pyspark already
    imported: it is, in a worker); None anywhere else."""
    task_context = sys.modules.get("pyspark.taskcontext")
    return None if task_context is None else task_context.TaskContext.get()


def set_threads(local_size: int) -> None:
    # Ranks on one machine share its cores: without this each rank starts one thread per core
    # and they fight (on 2 cores, 2 ranks x 2 threads is markedly slower than 2 x 1).
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_size)))


__all__ = ["HorovodGroup", "LocalGroup", "Pending", "TorchGroup", "attempt_key", "attempt_store", "in_process_device",
           "pick_device", "rendezvous_store", "set_threads", "spark_gpu_addresses"]
