"""The arithmetic every rank agrees on: which rows of a split a rank owns, how many optimizer
steps an epoch has, how many rows an epoch skips, and each (epoch, rank)'s shuffle seed.

N = rows in the split, W = world size. Rank r owns the rows whose ``_row`` lies in
``[r*N//W, (r+1)*N//W)``; ``steps_per_epoch = (N // W) // (batch_size * grad_accum)``, the same on
every rank, computed from the manifest before anything launches (``training.plan``) and again by
each rank's loader (``training.data``). Pure functions of numbers: no I/O, nothing imported but numpy.
"""

from __future__ import annotations

import numpy as np


def rank_row_range(total_rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """The half-open ``_row`` range rank ``rank`` of ``world_size`` owns."""
    return rank * total_rows // world_size, (rank + 1) * total_rows // world_size


def steps_per_epoch(total_rows: int, world_size: int, batch_size: int, grad_accum: int = 1) -> int:
    """Optimizer steps per epoch, identical on every rank (the smallest range decides)."""
    return (total_rows // world_size) // (batch_size * grad_accum)


def skipped_rows_per_epoch(total_rows: int, world_size: int, batch_size: int, grad_accum: int = 1) -> int:
    """Rows no rank trains on in an epoch; always < world_size * batch_size * grad_accum."""
    return total_rows - world_size * steps_per_epoch(total_rows, world_size, batch_size, grad_accum) * batch_size * grad_accum


def epoch_seed(seed: int, epoch: int, rank: int) -> int:
    # Distinct, reproducible streams per (seed, epoch, rank); fits petastorm's 32-bit RandomState.
    return int(np.random.SeedSequence([seed, epoch, rank]).generate_state(1)[0])


__all__ = ["epoch_seed", "rank_row_range", "skipped_rows_per_epoch", "steps_per_epoch"]
