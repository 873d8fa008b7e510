"""One process, the whole model, nothing to synchronise (``launch.mode=in_process``: notebooks,
debugging, GPU benchmarks). The base strategy as it is.

Rank-side only (imports torch).
"""

from __future__ import annotations

from training.strategies.base import Strategy


class SingleProcess(Strategy):
    name = "single"


__all__ = ["SingleProcess"]
