"""shardtrain's second stage: a published dataset (its manifest) -> Horovod-on-Spark PyTorch
training -> a model in storage. It reads the dataset contract from ``common.dataset`` and never
imports ``pipelines``.

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
