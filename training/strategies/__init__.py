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

Each strategy's module also owns what the driver checks of it: its config section
(``train.pipeline``, ``train.sync``), its refusals, the key that picks it and the kinds of rank
group it trains on (``training.strategies.base``). Adding a strategy is one new module here and
one line in ``REGISTRY``: ``technique``, ``check_strategy``, ``train.parallel``'s choices and the
ranks find it through this table, and the launchers offer it by the kind of ranks they start.

This module imports nothing heavy, and neither do the strategy modules at import time (the
driver's config check imports them); torch is imported when a rank builds a strategy.
"""

from __future__ import annotations

import functools
import importlib

from common.errors import ConfigError
from training.strategies.base import key_value

# "module:Class" of every strategy. A technique may have one class per kind of rank group (DDP on
# torch.distributed and on Horovod). ``technique`` asks them in this order whether the config picks
# them: pipeline stages, then rounds of local steps, then how the model is laid out (train.parallel).
REGISTRY = (
    "training.strategies.pipeline:PipelineParallel",
    "training.strategies.periodic:LocalSGD",
    "training.strategies.periodic:DiLoCo",
    "training.strategies.ddp:DistributedDataParallel",
    "training.strategies.horovod:HorovodDataParallel",
    "training.strategies.fsdp:FullyShardedDataParallel",
)
# What a one-process launcher (launch.mode=in_process, world size 1: nothing to lay out or
# synchronise) trains every technique with.
ONE_PROCESS = "training.strategies.single:SingleProcess"


@functools.cache
def strategy_classes() -> tuple:
    """The ``REGISTRY``'s classes, in its order (imports their modules; none imports torch)."""
    return tuple(_imported(target) for target in REGISTRY)


def _imported(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _techniques() -> dict:
    """Technique -> its first class in ``REGISTRY`` (what the driver reads of it is the same in each)."""
    found = {}
    for cls in strategy_classes():
        found.setdefault(cls.name, cls)
    return found


def picked_by(key: str) -> tuple[str, ...]:
    """The techniques ``key`` picks by naming them (``train.parallel``: its choices), in order."""
    return tuple(name for name, cls in _techniques().items() if cls.key == key)


def technique(train) -> str:
    """The technique ``train`` (a ``TrainLoopConfig``) asks for: the first in ``REGISTRY`` it picks
    (``pipeline`` when ``train.pipeline.stages`` > 1, its data-parallel side the pipeline's own;
    else the ``train.sync.mode`` when it is not ``every_step``; else ``train.parallel``)."""
    return next(name for name, cls in _techniques().items() if cls.picked(train))


def ranks_per_replica(train) -> int:
    """Ranks that hold one copy of the model together: the pipeline's stages, else 1. The
    data-parallel size (what rows are sharded by and equal steps computed from) is the world
    size divided by it."""
    return _techniques()[technique(train)].ranks_per_replica(train)


def model_shards(cfg) -> int:
    """Ranks that one copy of the model's training state is divided among under ``cfg``'s technique."""
    return _techniques()[technique(cfg.train)].model_shards(cfg)


def check_strategy(cfg, launcher) -> None:
    """Refuse (exit 2, naming the key and what to set) a strategy ``cfg`` (a ``TrainConfig``) cannot
    run on ``launcher`` (``training.launchers.base.Launcher``), before anything launches: each
    technique the config picks checks itself, then the technique must train on the launcher's ranks."""
    train = cfg.train
    for cls in _techniques().values():
        if cls.picked(train):
            cls.check(cfg, launcher)
    name = technique(train)
    if launcher.one_process or _on_ranks(name, launcher.ranks) is not None:
        return
    from training.launchers import launchers_of_ranks

    key = _techniques()[name].key
    backend = cfg.launch.backend
    on = launchers_of_ranks({kind for cls in strategy_classes() if cls.name == name for kind in cls.ranks})
    offered = sorted({cls.name for cls in strategy_classes() if launcher.ranks in cls.ranks})
    raise ConfigError(f"{key}={key_value(train, key)} needs launch.backend={' or '.join(on)} (got "
                      f"launch.backend={backend}); on {backend} the strategies are {', '.join(offered)}")


def _on_ranks(name: str, ranks: str | None):
    return next((cls for cls in strategy_classes() if cls.name == name and ranks in cls.ranks), None)


def strategy_class(name: str, launcher):
    """The ``Strategy`` subclass of technique ``name`` on ``launcher``'s ranks."""
    cls = _imported(ONE_PROCESS) if launcher.one_process else _on_ranks(name, launcher.ranks)
    if cls is None:
        raise ConfigError(f"no strategy {name} on launch.backend={launcher.name}; choose one of "
                          f"{', '.join(sorted({c.name for c in strategy_classes() if launcher.ranks in c.ranks}))}")
    return cls


def build_strategy(config, group):
    """The strategy a rank of ``config`` (a ``TrainConfig``) trains with, on its rank ``group``."""
    from training.launchers import launcher_for
    from training.precision import Precision

    t = config.train
    cls = strategy_class(technique(t), launcher_for(config.launch))
    return cls.from_config(config, group, Precision(t.precision, group.device.type))


__all__ = ["ONE_PROCESS", "REGISTRY", "build_strategy", "check_strategy", "model_shards", "picked_by",
           "ranks_per_replica", "strategy_class", "strategy_classes", "technique"]
