"""The ``shardtrain`` command and what uses both stages (``run``: shard then train; ``sweep``:
Optuna trials over one dataset; ``demo``; ``doctor``). It sits above ``pipelines`` and ``training``;
nothing below imports it.

    common/  ->  pipelines/ (raw data -> shards + manifest)  ->  training/ (manifest -> model)  ->  shardtrain/

Notebook API, re-exported lazily (importing ``shardtrain`` starts neither Spark nor torch)::

    from shardtrain import generate_dataset, shard_dataset, train, load_train_config, load_model, run
"""

from common import __version__

_NAMES = {
    "generate_dataset": "pipelines", "shard_dataset": "pipelines", "read_manifest": "pipelines",
    "describe_dataset": "pipelines",
    "train": "training", "load_model": "training", "load_train_config": "training", "TrainConfig": "training",
    "run": "shardtrain.run", "load_run_config": "shardtrain.run", "RunConfig": "shardtrain.run",
    "RunResult": "shardtrain.run",
    "sweep": "shardtrain.sweep", "load_sweep_config": "shardtrain.sweep_config",
    "SweepConfig": "shardtrain.sweep_config",
}

__all__ = ["__version__", *_NAMES]


def __getattr__(name):
    if name in _NAMES:
        import importlib

        return getattr(importlib.import_module(_NAMES[name]), name)
    raise AttributeError(f"module 'shardtrain' has no attribute {name!r}")
