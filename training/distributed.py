"""The few collective operations the training loop needs, for Horovod ranks and for one process.

The loop is written once against this interface; ``LocalGroup`` (world size 1, no Horovod)
serves the in-process mode, notebooks and GPU benchmarks, ``HorovodGroup`` the Horovod ranks,
``TorchGroup`` the torch.distributed ranks TorchDistributor starts (DDP, or FSDP2 sharding).
Also resolves which device a rank uses from the GPU addresses Spark assigned to its task.

Rank-side only (imports torch).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import torch

from common.devices import resolve_device  # noqa: F401 - re-exported for the rank side

log = logging.getLogger("shardtrain.train")


class _WholeModelOnEveryRank:
    """State dicts, loading and export for groups where each rank holds the whole, unwrapped
    model (one process, Horovod): the module's own state is the full state."""

    def model_state_dict(self, model) -> dict:
        return model.state_dict()

    def optimizer_state_dict(self, model, optimizer) -> dict:
        return optimizer.state_dict()

    def load_state_dicts(self, model, optimizer, model_state: dict, optimizer_state: dict) -> None:
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)

    def unsharded(self, model, build):
        return model


class LocalGroup(_WholeModelOnEveryRank):
    rank, size, local_rank, local_size = 0, 1, 0, 1

    def wrap_model(self, model):
        return model

    def accumulate(self, model, sync: bool):
        return contextlib.nullcontext()

    def distributed_optimizer(self, optimizer, model, backward_passes_per_step: int):
        return optimizer

    def synchronize(self, optimizer) -> None:
        pass

    def allreduce_wait(self, synchronize_started: float) -> float:
        return 0.0  # one process: nothing to wait for

    def skip_synchronize(self, optimizer):
        return contextlib.nullcontext()

    def broadcast_model(self, model, optimizer) -> None:
        pass

    def broadcast_object(self, obj):
        return obj

    def allgather_object(self, obj) -> list:
        return [obj]

    def allreduce_sum(self, tensor):
        return tensor

    def allreduce_min(self, tensor):
        return tensor

    def shutdown(self) -> None:
        pass


class HorovodGroup(_WholeModelOnEveryRank):
    def __init__(self):
        import horovod.torch as hvd

        hvd.init()
        self.hvd = hvd
        self.refresh()

    def refresh(self) -> None:
        """Read rank and size again: Horovod elastic renumbers the ranks after one left."""
        hvd = self.hvd
        self.rank, self.size = hvd.rank(), hvd.size()
        self.local_rank, self.local_size = hvd.local_rank(), hvd.local_size()

    def wrap_model(self, model):
        return model  # gradients are averaged by the DistributedOptimizer instead

    def accumulate(self, model, sync: bool):
        return contextlib.nullcontext()  # the DistributedOptimizer counts backward passes itself

    def distributed_optimizer(self, optimizer, model, backward_passes_per_step: int):
        # Gradients are summed locally for backward_passes_per_step micro-batches, then averaged
        # across ranks in one allreduce: accumulation costs no extra communication.
        return self.hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             backward_passes_per_step=backward_passes_per_step,
                                             op=self.hvd.Average)

    def synchronize(self, optimizer) -> None:
        optimizer.synchronize()

    def allreduce_wait(self, synchronize_started: float) -> float:
        """Seconds the step waited for the gradient allreduce backward did not hide: Horovod
        starts it during backward and ``synchronize`` waits for the rest, so its duration."""
        return time.perf_counter() - synchronize_started

    def skip_synchronize(self, optimizer):
        return optimizer.skip_synchronize()

    def broadcast_model(self, model, optimizer) -> None:
        self.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        self.hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    def broadcast_object(self, obj):
        return self.hvd.broadcast_object(obj, root_rank=0)

    def allgather_object(self, obj) -> list:
        return self.hvd.allgather_object(obj)

    def allreduce_sum(self, tensor):
        return self.hvd.allreduce(tensor, op=self.hvd.Sum)

    def allreduce_min(self, tensor):
        return self.hvd.allreduce(tensor, op=self.hvd.Min)

    def shutdown(self) -> None:
        self.hvd.shutdown()


class TorchGroup:
    """The ranks of one torch.distributed job (torchrun's environment: RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT): Gloo on CPU, NCCL on CUDA.

    Gradients are averaged by DistributedDataParallel during backward (``wrap_model``), so
    ``synchronize`` has nothing left to do and the step needs no skip. ``accumulate`` turns DDP's
    allreduce off for all but the last micro-batch (``no_sync``): accumulation costs no extra
    communication, as with Horovod's ``backward_passes_per_step``. The arithmetic equals
    Horovod's: DDP divides by the world size before the sum, Horovod after, and both are exact
    for a power-of-two world size, so a checkpoint resumes on either backend.
    """

    def __init__(self, device_type: str = "cpu", parallel: str = "ddp", precision: str = "fp32"):
        import datetime
        import socket

        import torch.distributed as dist

        self.dist = dist
        self.parallel, self.precision = parallel, precision
        self.backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(self.backend, timeout=datetime.timedelta(seconds=_collective_timeout()))
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.device = torch.device(f"cuda:{torch.cuda.current_device()}" if device_type == "cuda" else "cpu")
        # TorchDistributor runs one torchrun per Spark task (LOCAL_WORLD_SIZE=1), but tasks can
        # share a machine: count the ranks per host, as Horovod does, so they share its cores.
        hosts = self.allgather_object(socket.gethostname())
        mine = hosts[self.rank]
        self.local_rank = hosts[:self.rank].count(mine)
        self.local_size = hosts.count(mine)
        self._last_bucket_started: float | None = None  # set by _timed_allreduce (DDP)

    def wrap_model(self, model):
        if self.parallel == "fsdp":
            return self._fully_shard(model)
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, device_ids=[self.device] if self.device.type == "cuda" else None)
        ddp.register_comm_hook(self, _timed_allreduce)
        return ddp

    def _fully_shard(self, model):
        """FSDP2: each Linear and Embedding its own unit (gathered only while it computes), then
        the root. Parameters become DTensors in place; ``model`` stays the module to call."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                  if self.precision == "bf16" else MixedPrecisionPolicy())
        units = [module for module in model.modules()
                 if module is not model and isinstance(module, (torch.nn.Linear, torch.nn.Embedding))]
        for module in units:
            fully_shard(module, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        timed = _timed_reduce_scatter(self)
        if timed is not None:
            for module in [*units, model]:
                module.set_custom_reduce_scatter(timed)
        return model

    def accumulate(self, model, sync: bool):
        if sync:
            return contextlib.nullcontext()
        if self.parallel == "fsdp":
            return _fsdp_no_sync(model)
        return model.no_sync()

    def distributed_optimizer(self, optimizer, model, backward_passes_per_step: int):
        return optimizer

    # Checkpoints and exports hold full state dicts in the plain module's format whatever the
    # sharding, so a run saved under FSDP resumes under DDP or Horovod and exports the same model.

    def model_state_dict(self, model) -> dict:
        """The plain module's state dict (FSDP: gathered, complete on rank 0 only, which writes)."""
        if self.parallel != "fsdp":
            return model.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def optimizer_state_dict(self, model, optimizer) -> dict:
        if self.parallel != "fsdp":
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        full = get_optimizer_state_dict(model, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return _by_index(full) if full else full

    def load_state_dicts(self, model, optimizer, model_state: dict, optimizer_state: dict) -> None:
        if self.parallel != "fsdp":
            model.load_state_dict(model_state)
            optimizer.load_state_dict(optimizer_state)
            return
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=True)
        set_model_state_dict(model, model_state, options=options)
        names = [name for name, _ in model.named_parameters()]
        set_optimizer_state_dict(model, optimizer, _by_name(optimizer_state, names), options=options)

    def unsharded(self, model, build):
        """A plain module with the trained weights for export (FSDP: every rank takes part in the
        gather; rank 0, which exports, gets a module built by ``build`` holding them)."""
        if self.parallel != "fsdp":
            return model
        state = self.model_state_dict(model)
        if self.rank != 0:
            return None
        plain = build()
        plain.load_state_dict(state)
        return plain

    def synchronize(self, optimizer) -> None:
        pass  # DDP's backward already left the averaged gradients in place

    def allreduce_wait(self, synchronize_started: float) -> float:
        """Seconds the step waited for the gradient allreduce backward did not hide. DDP waits
        inside backward, so timing ``synchronize`` reads 0: instead, the time from the start of
        the step's last bucket allreduce (all gradients computed by then) to the end of backward
        (``synchronize_started``), i.e. the communication still in flight when compute ran out.
        FSDP: the same, from the start of the step's last gradient reduce-scatter (0 on a torch
        without FSDP2's custom reduce-scatter hook, see ``_timed_reduce_scatter``)."""
        started, self._last_bucket_started = self._last_bucket_started, None
        return max(0.0, synchronize_started - started) if started is not None else 0.0

    def skip_synchronize(self, optimizer):
        return contextlib.nullcontext()

    def broadcast_model(self, model, optimizer) -> None:
        """Rank 0's parameters, buffers and optimizer state on every rank.

        A fresh optimizer is first given its state by one step on zero gradients, exactly as
        Horovod's ``broadcast_optimizer_state`` does, so both backends start from the same state
        (Adam's step count included) and train to identical weights.
        """
        if self.parallel == "fsdp":
            # Every rank built the same seeded model and loaded the same checkpoint.
            if not optimizer.state_dict()["state"]:
                _initialise_optimizer_state(optimizer)
            return
        with torch.no_grad():
            for tensor in model.state_dict().values():
                self.dist.broadcast(tensor, src=0)
        if not optimizer.state_dict()["state"]:
            _initialise_optimizer_state(optimizer)
        state = self.broadcast_object(optimizer.state_dict() if self.rank == 0 else None)
        if self.rank:
            optimizer.load_state_dict(state)

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


def _timed_allreduce(group: TorchGroup, bucket):
    """DDP's own allreduce (each rank's gradients divided by the world size, then summed), noting
    when each bucket starts it; the last one of a backward starts once every gradient is computed."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    group._last_bucket_started = time.perf_counter()
    return allreduce_hook(None, bucket)


def _timed_reduce_scatter(group: TorchGroup):
    """FSDP2's own reduce-scatter, noting when each starts (as ``_timed_allreduce`` does for DDP),
    or None where this torch has no ``set_custom_reduce_scatter`` to install it with."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
    except ImportError:  # the class lives in a private torch module: without it the wait reads 0
        return None
    if not hasattr(torch.distributed.fsdp.FSDPModule, "set_custom_reduce_scatter"):
        return None

    class TimedReduceScatter(DefaultReduceScatter):
        def __call__(self, *args, **kwargs):
            group._last_bucket_started = time.perf_counter()
            return super().__call__(*args, **kwargs)

    return TimedReduceScatter()


def _initialise_optimizer_state(optimizer) -> None:
    """One optimizer step on zero gradients (Horovod's way of creating the state to broadcast)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad()


def _by_index(full: dict) -> dict:
    """torch.distributed's full optimizer state dict (keyed by parameter name) in the format of
    ``optimizer.state_dict()`` (keyed by position), the format DDP and Horovod checkpoints hold."""
    names = [name for group in full["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(names)}
    return {"state": {index[name]: value for name, value in full["state"].items()},
            "param_groups": [{**group, "params": [index[n] for n in group["params"]]} for group in full["param_groups"]]}


def _by_name(state: dict, names: list[str]) -> dict:
    """The inverse of ``_by_index``: positions are those of ``model.named_parameters()``."""
    return {"state": {names[i]: value for i, value in state["state"].items()},
            "param_groups": [{**group, "params": [names[i] for i in group["params"]]} for group in state["param_groups"]]}


@contextlib.contextmanager
def _fsdp_no_sync(model):
    # FSDP2's no_sync: keep unsharded gradients and skip the reduce-scatter until the last micro-batch.
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


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
    try:
        from horovod.spark.task import get_available_devices
    except ImportError:
        return []
    return [str(a) for a in get_available_devices()]


def set_threads(local_size: int) -> None:
    # Ranks on one machine share its cores: without this each rank starts one thread per core
    # and they fight (on 2 cores, 2 ranks x 2 threads is markedly slower than 2 x 1).
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_size)))


__all__ = ["HorovodGroup", "LocalGroup", "TorchGroup", "resolve_device", "set_threads", "spark_gpu_addresses"]
