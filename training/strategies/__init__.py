"""How a rank trains in parallel: one ``Strategy`` per technique, picked by ``train.parallel``.

A strategy owns what differs between parallelism techniques (after Lightning Fabric's strategies):
wrapping the model, one optimizer step over its micro-batches (forward, backward under the
precision policy, gradient synchronisation, the update), a hook after each step, the data-parallel
rank and size the loader shards by, whether this rank computes the loss, the full state dicts that
checkpoints and exports hold, and whether a step is a safe checkpoint point. The rank loop
(``training.loop``) is written once against ``training.strategies.base.Strategy``; the
collectives it needs (broadcast, gather, reductions) come from the rank group
(``training.distributed``), which knows nothing of parallelism.

Adding a strategy is one new module here and one entry in ``REGISTRY``: the config check
(``check_parallel``), the launchers and the loop find it through this table.

This module imports nothing heavy: the driver's config validation reads ``REGISTRY``; the
strategy modules import torch (and Horovod) when a rank builds one.
"""

from __future__ import annotations

import importlib

from common.errors import ConfigError

# (technique, launch.backend) -> "module:class". The technique is ``train.parallel`` (how the
# model is laid out) unless ``train.sync.mode`` asks for rounds of local steps instead of
# every-step gradient averaging, which then names it. A launch in the driver's own process
# (launch.mode=in_process, world size 1: nothing to lay out or synchronise) trains with ``IN_PROCESS``.
REGISTRY = {
    ("ddp", "horovod"): "training.strategies.horovod:HorovodDataParallel",
    ("ddp", "torch"): "training.strategies.ddp:DistributedDataParallel",
    ("fsdp", "torch"): "training.strategies.fsdp:FullyShardedDataParallel",
    ("local_sgd", "horovod"): "training.strategies.periodic:LocalSGD",
    ("local_sgd", "torch"): "training.strategies.periodic:LocalSGD",
    ("diloco", "horovod"): "training.strategies.periodic:DiLoCo",
    ("diloco", "torch"): "training.strategies.periodic:DiLoCo",
}
IN_PROCESS = "training.strategies.single:SingleProcess"
# The techniques that replace every-step synchronisation, and the train.parallel each needs.
SYNC_MODES = {"local_sgd": "ddp", "diloco": "ddp"}


def technique(parallel: str, sync: str = "every_step") -> str:
    """The registry's name for a ``train.parallel`` and ``train.sync.mode``."""
    return parallel if sync == "every_step" else sync


def check_parallel(parallel: str, backend: str, mode: str, sync: str = "every_step") -> None:
    """Refuse (exit 2, naming the keys) what no strategy implements on ``launch.backend``."""
    if sync != "every_step" and parallel != SYNC_MODES.get(sync, parallel):
        raise ConfigError(f"train.sync.mode={sync} needs train.parallel={SYNC_MODES[sync]} (got {parallel}): FSDP2 "
                          "shards one model across all ranks, so there are no replicas to average in rounds; set "
                          f"train.parallel={SYNC_MODES[sync]} or train.sync.mode=every_step")
    name = technique(parallel, sync)
    if mode == "in_process" or (name, backend) in REGISTRY:
        return
    key = "train.parallel" if sync == "every_step" else "train.sync.mode"
    on = sorted({b for p, b in REGISTRY if p == name})
    offered = sorted({p for p, b in REGISTRY if b == backend})
    if on:
        raise ConfigError(f"{key}={name} needs launch.backend={' or '.join(on)} (got launch.backend="
                          f"{backend}); on {backend} the strategies are {', '.join(offered)}")
    raise ConfigError(f"{key}={name} is not a strategy shardtrain has; "
                      f"choose one of {', '.join(sorted({p for p, _ in REGISTRY}))}")


def strategy_class(parallel: str, backend: str, mode: str, sync: str = "every_step"):
    """The ``Strategy`` subclass for this launch (imports its module, and with it torch)."""
    check_parallel(parallel, backend, mode, sync)
    target = IN_PROCESS if mode == "in_process" else REGISTRY[(technique(parallel, sync), backend)]
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def build_strategy(config, group):
    """The strategy a rank of ``config`` (a ``TrainConfig``) trains with, on its rank ``group``."""
    from training.precision import Precision

    t, launch = config.train, config.launch
    cls = strategy_class(t.parallel, launch.backend, launch.mode, t.sync.mode)
    return cls(group, Precision(t.precision, group.device.type), config)


__all__ = ["IN_PROCESS", "REGISTRY", "build_strategy", "check_parallel", "strategy_class"]
