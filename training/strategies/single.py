"""One process, the whole model, nothing to synchronise (``launch.mode=in_process``: notebooks,
debugging, GPU benchmarks). The base strategy as it is: what a one-process launcher trains every
technique with (``training.strategies.ONE_PROCESS``), so it is in no registry line of its own.
"""

from __future__ import annotations

from training.strategies.base import Strategy


class SingleProcess(Strategy):
    name = "single"


__all__ = ["SingleProcess"]
