"""shardtrain's second stage: a published dataset (its manifest) -> data-parallel PyTorch training
on the cluster's executors -> a model in storage. It reads the dataset contract from
``common.dataset`` and never imports ``pipelines``.

The driver side resolves a run into a plain ``plan.RankPlan`` and hands it to ``launchers`` (in
process, Horovod-on-Spark, TorchDistributor), which start the ranks and decide retries. Every rank
runs the one loop of ``loop`` on a rank group (``distributed``: who the ranks are, their device,
collectives) with the strategy ``strategies`` picks (one process, Horovod, DDP, FSDP2, periodic
sync) on the network its ``model_specs`` spec builds (a built-in model or a plug-in); the loss,
validation metrics, baseline and serving head are the label's task's (``tasks``, one module per
task); rank 0 writes through ``recorder``.

The public API is re-exported lazily, so ``import training`` (the CLI, doctor) does not import
torch or horovod until one of these names is used.
"""

from common import __version__

_API = ("train", "load_model", "TrainResult", "handle_train")
_CONFIG = ("TrainConfig", "load_train_config")

__all__ = ["__version__", *_API, *_CONFIG]


def __getattr__(name):
    if name in _API:
        from training import api

        return getattr(api, name)
    if name in _CONFIG:
        from training import config

        return getattr(config, name)
    raise AttributeError(f"module 'training' has no attribute {name!r}")
