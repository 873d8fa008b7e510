"""Shuffle buffers: a rank's stream of Arrow row groups cut into buffers of
``data.shuffle_buffer_rows`` rows, each converted once into batch arrays already in batch order
(``ShuffleBuffers``), and the memory those arrays live in, used again from buffer to buffer
(``BufferMemory``).

It runs in the arrow reader's pipeline thread, or in the loader's own for petastorm. It neither
opens files nor decides which rows are the rank's (the loader's mask) or how columns become
arrays (``training.columns``); it imports neither torch nor petastorm.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from common.dataset import ROW_INDEX
from training.columns import Columns, tables_to_arrays


@dataclass
class ShuffleBuffer:
    """One shuffle buffer of batch arrays in batch order, made off the training thread where the
    reader allows: batch k is rows [k * batch_size, (k + 1) * batch_size) of ``arrays``, for k
    below ``full / batch_size``; ``rest``: the rows after ``full`` (views), which open the next
    buffer, or end the epoch's rows for validation."""

    arrays: dict[str, np.ndarray]
    full: int
    rows_read: int  # rows decoded for it, including those masked out
    rest: dict[str, np.ndarray] | None


class ShuffleBuffers:
    """One loader's shuffle buffers: ``for buffer in buffers.from_tables(tables, rng): ...``.

    ``mask`` keeps a table's rows that are the rank's; a buffer holds at least one batch. ``max_bytes``
    caps a buffer's stored bytes as ``rows`` caps its rows, whichever is reached first: each row
    group's bytes per row (its Arrow size over its rows, read before masking) turn it into rows,
    so a buffer of large rows (an image's encoded bytes) stops early.
    """

    def __init__(self, columns: Columns, batch_size: int, rows: int, shuffle: bool, memory: "BufferMemory",
                 mask: Callable, max_bytes: int | None = None):
        self.columns, self.batch_size, self.shuffle = columns, batch_size, shuffle
        self.rows = max(rows, batch_size)
        self.max_bytes = max_bytes
        self.memory, self.mask = memory, mask

    def _rows_for(self, table) -> int:
        """The buffer's rows while it takes rows like ``table``'s: ``rows``, or fewer where
        ``max_bytes`` is reached first (never fewer than a batch)."""
        if not self.max_bytes or not table.num_rows:
            return self.rows
        per_row = max(1.0, table.nbytes / table.num_rows)
        return max(self.batch_size, min(self.rows, int(self.max_bytes // per_row)))

    def from_tables(self, tables: Iterator, rng: np.random.Generator) -> Iterator[ShuffleBuffer]:
        """Row groups -> shuffle buffers in batch order.

        Each row group is masked to this rank's rows. A buffer takes the rows the previous one
        left over (fewer than a batch), then rows of the row groups in order up to exactly
        ``shuffle_buffer_rows`` (or the rows ``max_bytes`` allows, where fewer): a row group larger than what is missing is cut (a zero-copy
        slice), and its other rows open the next buffer. So a buffer's memory and the wait for the
        first batch follow ``shuffle_buffer_rows``, not the size of the row groups. Its rows are
        converted once into arrays and, when shuffling, permuted as a whole with the epoch's
        generator (one draw per buffer, in order). The buffer's own left-over rows (its last
        ``total % batch_size``) open the next buffer.
        """
        group, group_rows, rows_read = [], 0, 0
        rest = None
        for table in tables:
            rows_read += table.num_rows
            limit = self._rows_for(table)
            table = self.mask(table)
            while table.num_rows:
                missing = max(0, limit - (len(rest[ROW_INDEX]) if rest else 0) - group_rows)
                if missing == 0 and group:  # a smaller limit than the rows already taken: the buffer is full
                    buffer = self._buffer(group, rest, rows_read, rng)
                    rest, group, group_rows, rows_read = buffer.rest, [], 0, 0
                    yield buffer
                    continue
                missing = max(missing, 1)
                taken = min(table.num_rows, missing)
                group.append(table if taken == table.num_rows else table.slice(0, taken))
                group_rows += taken
                table = table.slice(taken)
                if taken < missing:
                    break  # the buffer is not full yet: the next row group
                buffer = self._buffer(group, rest, rows_read, rng)
                # The tables are let go before waiting to hand the buffer over.
                rest, group, group_rows, rows_read = buffer.rest, [], 0, 0
                yield buffer
        if group or rest or rows_read:
            yield self._buffer(group, rest, rows_read, rng)

    def _buffer(self, tables: list, rest: dict | None, rows_read: int, rng: np.random.Generator) -> ShuffleBuffer:
        total = (len(rest[ROW_INDEX]) if rest else 0) + sum(table.num_rows for table in tables)
        order = rng.permutation(total) if self.shuffle and total else None
        # Converted into batch order once, for the whole buffer: a batch is then a slice of it.
        arrays = tables_to_arrays(tables, self.columns, lead=rest, order=order, empty=self.memory.empty)
        full = total // self.batch_size * self.batch_size
        return ShuffleBuffer(arrays=arrays, full=full, rows_read=rows_read,
                             rest={name: value[full:] for name, value in arrays.items()} if full < total else None)


class BufferMemory:
    """The memory of a loader's shuffle buffers, used again once nothing refers to it.

    A buffer of the default 65,536 rows of the benchmark's tabular rows is about 6 MB of arrays
    and 5 MB of scratch. Taken fresh from malloc for every buffer, that memory came back from the
    kernel page by page, and the page faults cost about as much as the conversion itself
    (benchmarks/RESULTS.md, "Buffers cut to size, their memory reused"). So ``empty`` hands out a
    view of an array it made before when no one else refers to that array any more, and a new
    one otherwise.

    "No one else" is CPython's reference count of the array: a batch tensor (``torch.from_numpy``
    of a slice), the slice and the buffer's left-over rows each hold a reference to it, so an array
    still in use, by the training step or by a batch a caller kept, is never handed out again.
    Only the thread that builds buffers calls ``empty``; other threads only drop references, which
    can only make an array free later, never in use again. What it keeps is what the next epoch
    needs again: about three buffers (the one being built, the one waiting, the one being read).

    Several loaders can share one as long as they never build buffers at the same time (a
    rank's training and validation loaders: each epoch's reader thread is joined before the
    next pass starts), so what it holds is the larger of their needs, not the sum.
    """

    def __init__(self, keep: int = 32):
        self._arrays: list[np.ndarray] = []
        self._keep = keep  # arrays kept; beyond that the oldest is left to its holders
        self.reused = 0  # arrays handed out again (benchmarks and tests read it)
        probe = np.empty(0)
        self._free_refs = _refs(probe)  # the count of an array only this code refers to

    def empty(self, shape: tuple, dtype) -> np.ndarray:
        """An uninitialized array of ``shape`` and ``dtype`` (a view of a reused one, or new)."""
        dtype = np.dtype(dtype)
        rows, tail = shape[0], tuple(shape[1:])
        smaller = []
        for index in range(len(self._arrays)):
            array = self._arrays[index]
            if array.dtype != dtype or array.shape[1:] != tail or _refs(array) > self._free_refs + 1:
                continue  # another kind, or in use (+ 1: the list holds it)
            if array.shape[0] >= rows:
                self.reused += 1
                return array[:rows]
            smaller.append(index)
        for index in reversed(smaller):  # free but too small: a new one takes its place
            del self._arrays[index]
        array = np.empty((rows, *tail), dtype=dtype)
        self._arrays.append(array)
        if len(self._arrays) > self._keep:
            del self._arrays[0]  # left to whoever still holds it
        return array


def _refs(array: np.ndarray) -> int:
    return sys.getrefcount(array)


__all__ = ["BufferMemory", "ShuffleBuffer", "ShuffleBuffers"]
