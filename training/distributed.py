"""The few collective operations the training loop needs, for Horovod ranks and for one process.

The loop is written once against this interface; ``LocalGroup`` (world size 1, no Horovod)
serves the in-process mode, notebooks and GPU benchmarks, ``HorovodGroup`` the Spark ranks.
Also resolves which device a rank uses from the GPU addresses Spark assigned to its task.

Rank-side only (imports torch).
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch

log = logging.getLogger("shardtrain.train")


class LocalGroup:
    rank, size, local_rank, local_size = 0, 1, 0, 1

    def distributed_optimizer(self, optimizer, model, backward_passes_per_step: int):
        return optimizer

    def synchronize(self, optimizer) -> None:
        pass

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


class HorovodGroup:
    def __init__(self):
        import horovod.torch as hvd

        hvd.init()
        self.hvd = hvd
        self.rank, self.size = hvd.rank(), hvd.size()
        self.local_rank, self.local_size = hvd.local_rank(), hvd.local_size()

    def distributed_optimizer(self, optimizer, model, backward_passes_per_step: int):
        # Gradients are summed locally for backward_passes_per_step micro-batches, then averaged
        # across ranks in one allreduce: accumulation costs no extra communication.
        return self.hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                             backward_passes_per_step=backward_passes_per_step,
                                             op=self.hvd.Average)

    def synchronize(self, optimizer) -> None:
        optimizer.synchronize()

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


def resolve_device(gpu_addresses: list[str], cuda_available: bool, visible_devices: str | None) -> tuple[str, str]:
    """(torch device, why) for a rank given the GPU addresses Spark assigned to its task.

    Spark addresses are the discovery script's physical ids. When CUDA_VISIBLE_DEVICES is set
    (YARN, Kubernetes), CUDA renumbers the visible devices from 0, so the address is looked up
    in that list (the wrong-GPU-index bug of horovod PR #3737).
    """
    if not gpu_addresses:
        return "cpu", "no GPU assigned to this task by Spark"
    address = str(gpu_addresses[0])
    if not cuda_available:
        return "cpu", f"Spark assigned GPU address {address}, but CUDA is not available in this process; using CPU"
    if visible_devices:
        visible = [v.strip() for v in visible_devices.split(",") if v.strip()]
        if address in visible:
            return f"cuda:{visible.index(address)}", f"Spark GPU address {address} (CUDA_VISIBLE_DEVICES={visible_devices})"
        if len(visible) == 1:
            return "cuda:0", f"Spark GPU address {address}; the only visible device"
    return f"cuda:{int(address)}", f"Spark GPU address {address}"


def spark_gpu_addresses() -> list[str]:
    """The GPU addresses of the Spark task this Horovod rank was launched from."""
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


__all__ = ["HorovodGroup", "LocalGroup", "resolve_device", "set_threads", "spark_gpu_addresses"]
