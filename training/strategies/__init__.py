"""How a rank trains in parallel: one ``Strategy`` per technique, picked by ``train.parallel``
(and ``train.pipeline.stages``: more than 1 is pipeline parallelism, see ``technique``).

A strategy owns what differs between parallelism techniques (after Lightning Fabric's strategies):
wrapping the model, one optimizer step over its micro-batches (forward, backward under the
precision policy, gradient synchronisation, the update), a hook after each step, the data-parallel
rank and size the loader shards by, whether this rank computes the loss, the full state dicts that
checkpoints and exports hold, and whether a step is a safe checkpoint point. The rank loop
(``training.loop``) is written once against ``training.strategies.base.Strategy``; the
collectives it needs (broadcast, gather, reductions) come from the rank group
(``training.distributed``), which knows nothing of parallelism.

Adding a strategy is one new module here and one entry in ``REGISTRY``: the config check
(``check_strategy``), the launchers and the loop find it through this table. ``technique`` is the
one place that reads which technique a config asks for; ``ranks_per_replica`` says how many ranks
hold one copy of the model together (the plan divides the world by it for equal steps).

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
    ("pipeline", "torch"): "training.strategies.pipeline:PipelineParallel",
}
IN_PROCESS = "training.strategies.single:SingleProcess"


def technique(train) -> str:
    """The ``REGISTRY`` name of what ``train`` (a ``TrainLoopConfig``) asks for: ``pipeline`` when
    ``train.pipeline.stages`` > 1 (its data-parallel side is the pipeline strategy's own), else
    ``train.parallel``."""
    return "pipeline" if train.pipeline.stages > 1 else train.parallel


def ranks_per_replica(train) -> int:
    """Ranks that hold one copy of the model together: the pipeline's stages, else 1. The
    data-parallel size (what rows are sharded by and equal steps computed from) is the world
    size divided by it."""
    return train.pipeline.stages


def check_strategy(train, launch, model) -> None:
    """Refuse (exit 2, naming the key and what to set) a strategy the config cannot run, before
    anything launches. ``train``, ``launch``, ``model``: the config's sections."""
    if train.pipeline.stages > 1:
        _check_pipeline(train, launch, model)
    check_parallel(technique(train), launch.backend, launch.mode)


def _check_pipeline(train, launch, model) -> None:
    stages = train.pipeline.stages
    if launch.backend != "torch":
        raise ConfigError(f"train.pipeline.stages={stages} needs launch.backend=torch (got launch.backend="
                          f"{launch.backend}: Horovod has no point-to-point sends between stages); set "
                          "launch.backend=torch or train.pipeline.stages=1")
    if train.parallel != "ddp":
        # Each stage is replicated across the data-parallel ranks with replicate(); FSDP2 units
        # inside stages are wrong with some schedules unless built for it, and are not built here.
        raise ConfigError(f"train.parallel={train.parallel} with train.pipeline.stages={stages} is not built: the "
                          "stages are replicated across data-parallel ranks; set train.parallel=ddp or "
                          "train.pipeline.stages=1")
    if launch.num_proc % stages:
        raise ConfigError(f"launch.num_proc={launch.num_proc} is not a multiple of train.pipeline.stages={stages}: "
                          f"every data-parallel replica is one whole pipeline; set launch.num_proc to a multiple of "
                          f"{stages}" + (" (with launch.mode=spark)" if launch.mode == "in_process" else ""))
    parts = stages * train.pipeline.stages_per_rank
    if model.name == "mlp" and len(model.hidden) + 1 < parts:
        # The MLP's blocks (one per hidden layer, plus the output layer) are the units a stage holds.
        raise ConfigError(f"model.hidden={model.hidden} gives {len(model.hidden) + 1} layer(s), fewer than the "
                          f"{parts} pipeline stage(s) (train.pipeline.stages x stages_per_rank); add hidden layers "
                          "or use fewer stages")


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
    cls = strategy_class(technique(t), launch.backend, launch.mode)
    return cls.from_config(config, group, Precision(t.precision, group.device.type))


__all__ = ["IN_PROCESS", "REGISTRY", "build_strategy", "check_parallel", "check_strategy", "ranks_per_replica",
           "strategy_class", "technique"]
