"""How a rank trains in parallel: one ``Strategy`` per technique, picked by ``train.parallel``,
``train.pipeline.stages`` (more than 1 is pipeline parallelism) and ``train.sync.mode`` (rounds of
local steps instead of every-step averaging); ``technique`` reads which.

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

# (technique, launch.backend) -> "module:class". The technique is what ``technique`` reads from
# the config: pipeline stages, else rounds of local steps (``train.sync.mode``), else how the model
# is laid out (``train.parallel``). A launch in the driver's own process (launch.mode=in_process,
# world size 1: nothing to lay out or synchronise) trains with ``IN_PROCESS``.
REGISTRY = {
    ("ddp", "horovod"): "training.strategies.horovod:HorovodDataParallel",
    ("ddp", "torch"): "training.strategies.ddp:DistributedDataParallel",
    ("fsdp", "torch"): "training.strategies.fsdp:FullyShardedDataParallel",
    ("pipeline", "torch"): "training.strategies.pipeline:PipelineParallel",
    ("local_sgd", "horovod"): "training.strategies.periodic:LocalSGD",
    ("local_sgd", "torch"): "training.strategies.periodic:LocalSGD",
    ("diloco", "horovod"): "training.strategies.periodic:DiLoCo",
    ("diloco", "torch"): "training.strategies.periodic:DiLoCo",
}
# torchrun's ranks and those inside Spark's tasks are torch.distributed ranks, as TorchDistributor's
# are: the torch strategies.
REGISTRY.update({(name, other): target for (name, backend), target in list(REGISTRY.items()) if backend == "torch"
                 for other in ("torch_tasks", "torchrun")})
IN_PROCESS = "training.strategies.single:SingleProcess"


def technique(train) -> str:
    """The ``REGISTRY`` name of what ``train`` (a ``TrainLoopConfig``) asks for: ``pipeline`` when
    ``train.pipeline.stages`` > 1 (its data-parallel side is the pipeline strategy's own), the
    ``train.sync.mode`` when it is not ``every_step``, else ``train.parallel``."""
    if train.pipeline.stages > 1:
        return "pipeline"
    return train.parallel if train.sync.mode == "every_step" else train.sync.mode


def ranks_per_replica(train) -> int:
    """Ranks that hold one copy of the model together: the pipeline's stages, else 1. The
    data-parallel size (what rows are sharded by and equal steps computed from) is the world
    size divided by it."""
    return train.pipeline.stages


def check_strategy(train, launch, model, checkpoint) -> None:
    """Refuse (exit 2, naming the key and what to set) a strategy the config cannot run, before
    anything launches. ``train``, ``launch``, ``model``, ``checkpoint``: the config's sections."""
    if train.pipeline.stages > 1:
        _check_pipeline(train, launch, model)
    if train.sync.mode != "every_step":
        _check_sync(train, launch, checkpoint)
    name = technique(train)
    if launch.mode == "in_process" or (name, launch.backend) in REGISTRY:
        return
    key = ("train.pipeline.stages" if name == "pipeline" else
           "train.parallel" if name == train.parallel else "train.sync.mode")
    on = sorted({b for p, b in REGISTRY if p == name})
    offered = sorted({p for p, b in REGISTRY if b == launch.backend})
    if on:
        raise ConfigError(f"{key}={getattr_path(train, key)} needs launch.backend={' or '.join(on)} (got "
                          f"launch.backend={launch.backend}); on {launch.backend} the strategies are "
                          f"{', '.join(offered)}")
    raise ConfigError(f"{key}={name} is not a strategy shardtrain has; "
                      f"choose one of {', '.join(sorted({p for p, _ in REGISTRY}))}")


def getattr_path(train, key: str):
    value = train
    for part in key.split(".")[1:]:
        value = getattr(value, part)
    return value


def _check_pipeline(train, launch, model) -> None:
    stages = train.pipeline.stages
    if ("pipeline", launch.backend) not in REGISTRY:
        raise ConfigError(f"train.pipeline.stages={stages} needs launch.backend=torch (got launch.backend="
                          f"{launch.backend}: Horovod has no point-to-point sends between stages); set "
                          "launch.backend=torch or train.pipeline.stages=1")
    if train.parallel != "ddp":
        # Each stage is replicated across the data-parallel ranks; FSDP2 units inside stages are
        # wrong with some schedules unless built for it, and are not built here.
        raise ConfigError(f"train.parallel={train.parallel} with train.pipeline.stages={stages} is not built: the "
                          "stages are replicated across data-parallel ranks; set train.parallel=ddp or "
                          "train.pipeline.stages=1")
    if train.sync.mode != "every_step":
        raise ConfigError(f"train.sync.mode={train.sync.mode} with train.pipeline.stages={stages} is not built: a "
                          "pipeline's replicas average their gradients every step; set train.sync.mode=every_step "
                          "or train.pipeline.stages=1")
    if launch.num_proc % stages:
        raise ConfigError(f"launch.num_proc={launch.num_proc} is not a multiple of train.pipeline.stages={stages}: "
                          f"every data-parallel replica is one whole pipeline; set launch.num_proc to a multiple of "
                          f"{stages}" + (" (with launch.mode=spark)" if launch.mode == "in_process" else ""))
    parts = stages * train.pipeline.stages_per_rank
    # The built-in models' blocks are the units a stage holds: the MLP's hidden layers plus its
    # output layer, the FT-Transformer's transformer blocks.
    if model.name == "mlp" and len(model.hidden) + 1 < parts:
        raise ConfigError(f"model.hidden={model.hidden} gives {len(model.hidden) + 1} layer(s), fewer than the "
                          f"{parts} pipeline stage(s) (train.pipeline.stages x stages_per_rank); add hidden layers "
                          "or use fewer stages")
    if model.name == "ft_transformer" and model.layers < parts:
        raise ConfigError(f"model.layers={model.layers} is fewer than the {parts} pipeline stage(s) (train.pipeline."
                          "stages x stages_per_rank): a stage holds whole blocks; raise model.layers or use fewer stages")
    if isinstance(train.pipeline.split, list):
        from training.model_shape import block_names

        names = block_names(model)
        if names is not None:  # a plug-in model's blocks are known once a rank builds it
            check_split(train.pipeline.split, names, model.name)


def check_split(split: list[list[str]], names: list[str] | None, model_name: str) -> None:
    """An explicit ``train.pipeline.split`` lists every block of the model once, in order (exit 2
    otherwise): on the driver for the built-in models, on the ranks for a plug-in."""
    if names is None or [name for stage in split for name in stage] != names:
        raise ConfigError(f"train.pipeline.split={split} must list every block of model {model_name} once, in order, "
                          f"cut into stages: its blocks are {names}; or set train.pipeline.split=auto")


# The techniques that replace every-step synchronisation, and the train.parallel each needs.
SYNC_MODES = {"local_sgd": "ddp", "diloco": "ddp"}


def _check_sync(train, launch, checkpoint) -> None:
    sync = train.sync
    if train.parallel != SYNC_MODES[sync.mode]:
        raise ConfigError(f"train.sync.mode={sync.mode} needs train.parallel={SYNC_MODES[sync.mode]} (got "
                          f"{train.parallel}): FSDP2 shards one model across all ranks, so there are no replicas to "
                          f"average in rounds; set train.parallel={SYNC_MODES[sync.mode]} or train.sync.mode=every_step")
    if launch.elastic:
        raise ConfigError(f"launch.elastic does not combine with train.sync.mode={sync.mode} (a reset would drop the "
                          "replicas' own optimizer state and the rounds' schedule); set launch.elastic=false or "
                          "train.sync.mode=every_step")
    every_steps = checkpoint.every_steps
    if sync.overlap and every_steps is not None:
        raise ConfigError("checkpoint.every_steps must be null with train.sync.overlap=true: a round's average is "
                          "still in flight mid-epoch, so only epoch ends are checkpoint points (checkpoint.every_epochs)")
    if not sync.overlap and every_steps is not None and every_steps % sync.every:
        raise ConfigError(f"checkpoint.every_steps must be a multiple of train.sync.every={sync.every} with "
                          f"train.sync.mode={sync.mode}: only steps where the replicas agree are checkpoint points")


def strategy_class(name: str, backend: str, mode: str):
    """The ``Strategy`` subclass of technique ``name`` on ``backend`` (imports its module, and with it torch)."""
    target = IN_PROCESS if mode == "in_process" else REGISTRY.get((name, backend))
    if target is None:
        raise ConfigError(f"no strategy {name} on launch.backend={backend}; "
                          f"choose one of {', '.join(sorted({p for p, b in REGISTRY if b == backend}))}")
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)


def build_strategy(config, group):
    """The strategy a rank of ``config`` (a ``TrainConfig``) trains with, on its rank ``group``."""
    from training.precision import Precision

    t, launch = config.train, config.launch
    cls = strategy_class(technique(t), launch.backend, launch.mode)
    return cls.from_config(config, group, Precision(t.precision, group.device.type))


__all__ = ["IN_PROCESS", "REGISTRY", "SYNC_MODES", "build_strategy", "check_split", "check_strategy", "ranks_per_replica",
           "strategy_class", "technique"]
