"""shardtrain's second stage: a published dataset (its manifest) -> Horovod-on-Spark PyTorch
training -> a model in storage. Depends on ``pipelines`` for the dataset contract, never the reverse.
"""

from pipelines import __version__

__all__ = ["__version__"]
