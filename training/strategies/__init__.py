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

# (train.parallel, launch.backend) -> "module:class". A launch in the driver's own process
# (launch.mode=in_process, world size 1) always trains with ``IN_PROCESS``.
REGISTRY = {
    ("ddp", "horovod"): "training.strategies.horovod:HorovodDataParallel",
    ("ddp", "torch"): "training.strategies.ddp:DistributedDataParallel",
    ("fsdp", "torch"): "training.strategies.fsdp:FullyShardedDataParallel",
}
IN_PROCESS = "training.strategies.single:SingleProcess"


def check_parallel(parallel: str, backend: str, mode: str) -> None:
    """Refuse (exit 2, naming the keys) a ``train.parallel`` no strategy implements on ``launch.backend``."""
    if mode == "in_process" or (parallel, backend) in REGISTRY:
        return
    on = sorted({b for p, b in REGISTRY if p == parallel})
    offered = sorted({p for p, b in REGISTRY if b == backend})
    if on:
        raise ConfigError(f"train.parallel={parallel} needs launch.backend={' or '.join(on)} (got launch.backend="
                          f"{backend}); on {backend} train.parallel can be {', '.join(offered)}")
    raise ConfigError(f"train.parallel={parallel} is not a strategy shardtrain has; "
                      f"choose one of {', '.join(sorted({p for p, _ in REGISTRY}))}")


def strategy_class(parallel: str, backend: str, mode: str):
    """The ``Strategy`` subclass for this launch (imports its module, and with it torch)."""
    check_parallel(parallel, backend, mode)
    target = IN_PROCESS if mode == "in_process" else REGISTRY[(parallel, backend)]
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def build_strategy(config, group):
    """The strategy a rank of ``config`` (a ``TrainConfig``) trains with, on its rank ``group``."""
    from training.precision import Precision

    t, launch = config.train, config.launch
    cls = strategy_class(t.parallel, launch.backend, launch.mode)
    return cls(group, Precision(t.precision, group.device.type))


__all__ = ["IN_PROCESS", "REGISTRY", "build_strategy", "check_parallel", "strategy_class"]
