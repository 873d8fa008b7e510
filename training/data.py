"""Each rank's input pipeline: published shards -> a row-group reader -> shuffled torch batches,
with the same number of batches on every rank. This module is the loader; each piece it puts
together is its own module beside it:

* ``training.epoch_steps``: the arithmetic every rank agrees on (its rows, steps per epoch, seeds);
* ``training.split_layout``: the split's files as planned, their integrity and pinning checks;
* ``training.arrow_reader`` / ``training.petastorm_reader``: the two readers (``data.reader``),
  the same Arrow tables in the same order;
* ``training.shuffle_buffers``: row groups -> shuffle buffers in batch order, and their memory;
* ``training.columns``: which columns make a batch and the Arrow -> numpy conversion;
* ``training.image_loading``: the decode stage, which decodes (and on the train split augments)
  encoded entries, image columns, batch by batch after the shuffle buffers.

Why not petastorm's own sharding (``cur_shard=rank, shard_count=size``): it deals whole row
groups round-robin, so ranks get as many rows as their row groups happen to hold. With unequal
row groups one rank runs out first and the others wait in allreduce forever (the classic
Horovod hang). Instead the split is cut by row index:

* N = rows in the split, W = world size. Rank r owns the rows whose ``_row`` (the row's position
  in the split: files in manifest order, rows in order) lies in ``[r*N//W, (r+1)*N//W)``.
* ``steps_per_epoch = (N // W) // (batch_size * grad_accum)``, the same on every rank, computed
  from the manifest before anything launches.
* Each rank reads only the files that overlap its range, masks the rows outside it by ``_row``
  (vectorized), shuffles within a buffer, and yields exactly ``steps_per_epoch * grad_accum``
  full batches, then stops its reader.

Rows skipped per epoch: ``N - W * steps_per_epoch * batch_size * grad_accum``, always fewer
than ``W * batch_size * grad_accum`` (plus nothing else: no row is repeated). Which rows are
skipped changes every epoch, because the order is reshuffled with a per-epoch seed.

Before a reader opens shard files the loader checks them (``SplitLayout.verify_files``: sha256
on first read, the planned version on every open) and, once a pass has read its rows, checks
their versions again: a dataset rewritten under the run is a ``DatasetChangedError`` (exit 1).

The order is a pure function of (seed, epoch, rank) when ``reader_workers == 1``, so a resume
position is just (epoch, step). This module owns the data path and nothing else: no model, no
Horovod, no Spark. Nothing here runs per row in Python; torch and the readers are imported only
on the ranks, when a loader yields batches.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from common.errors import DatasetError
from common.dataset import ROW_INDEX
from common.storage import resolve, storage_errors
from training.columns import Columns, batch_of, table_to_arrays
from training.epoch_steps import epoch_seed, rank_row_range, steps_per_epoch
from training.image_loading import DecodeStage, ImageAugment
from training.shuffle_buffers import BufferMemory, ShuffleBuffers
from training.split_layout import SplitLayout


@dataclass
class EpochStats:
    """What one rank's loader delivered in one epoch (returned to the driver; tests assert on it)."""

    epoch: int
    batches: int = 0
    rows: int = 0
    duplicate_rows: int = 0
    min_row: int = -1
    max_row: int = -1
    rows_read: int = 0  # rows decoded, including those masked out or left over


class RankLoader:
    """One rank's batches for one epoch at a time: ``for batch in loader.epoch(e): ...``.

    A batch is a dict of torch tensors: ``numeric`` float32 [B, n_numeric], ``categorical`` int64
    [B, n_categorical], each array feature float32 [B, *shape], each image feature uint8 [B, C, H, W]
    (decoded, and augmented where ``augments`` names it, by ``decode_workers`` threads), ``label`` (int64 or float32 [B]),
    ``teacher`` float32 [B, num_classes] or [B] when the columns include it, and ``_row`` int64 [B].
    """

    def __init__(self, layout: SplitLayout, columns: Columns, rank: int, world_size: int, batch_size: int,
                 grad_accum: int = 1, seed: int = 0, shuffle: bool = True, shuffle_buffer_rows: int = 65_536,
                 reader_workers: int = 1, prefetch_row_groups: int = 4, reader: str = "petastorm",
                 memory: "BufferMemory | None" = None, shuffle_buffer_bytes: int | None = None,
                 decode_workers: int = 1, augments: "dict[str, ImageAugment | None] | None" = None):
        self.layout, self.columns = layout, columns
        self.rank, self.world_size = rank, world_size
        self.batch_size, self.grad_accum, self.seed, self.shuffle = batch_size, grad_accum, seed, shuffle
        self.reader_workers, self.prefetch_row_groups = reader_workers, prefetch_row_groups
        self.reader = reader  # "petastorm" or "arrow" (training.*_reader): the same tables in the same order
        self.lo, self.hi = rank_row_range(layout.rows, rank, world_size)
        self.steps_per_epoch = steps_per_epoch(layout.rows, world_size, batch_size, grad_accum)
        self.batches_per_epoch = self.steps_per_epoch * grad_accum
        self.files = layout.files_overlapping(self.lo, self.hi)
        self.stats: list[EpochStats] = []
        # The shuffle buffers' memory, used again from epoch to epoch; loaders that never build
        # buffers at the same time (a rank's training and validation) can share one.
        self.memory = memory if memory is not None else BufferMemory()
        self.buffers = ShuffleBuffers(columns, batch_size, shuffle_buffer_rows, shuffle, self.memory, self._mask,
                                      max_bytes=shuffle_buffer_bytes)
        self.prefetch_bytes = shuffle_buffer_bytes
        # Encoded entries (images) are decoded batch by batch, after the shuffle buffer.
        self.decoder = DecodeStage(list(columns.features), decode_workers, augments, seed)

    def epoch(self, epoch: int, skip_batches: int = 0) -> Iterator[dict]:
        """Exactly ``batches_per_epoch - skip_batches`` batches; the first ``skip_batches`` of the
        epoch's order are read but not built (resume)."""
        import torch

        stats = EpochStats(epoch=epoch)
        self.stats.append(stats)
        seen = np.zeros(self.hi - self.lo, dtype=bool)
        emitted = 0
        encoded = self._shuffled_batches(epoch, stats)
        batches = self.decoder.batches(encoded, epoch, augment=True, skip=skip_batches)
        try:
            for arrays in batches:
                rows = arrays[ROW_INDEX]
                local = rows - self.lo
                stats.duplicate_rows += int(np.count_nonzero(seen[local]))
                seen[local] = True
                stats.batches += 1
                stats.rows += len(rows)
                emitted += 1
                if emitted > skip_batches:
                    yield {name: torch.from_numpy(value) for name, value in arrays.items()}
                if emitted == self.batches_per_epoch:
                    break
        finally:
            batches.close()
            encoded.close()  # stops the reader now, not when the generator is collected
        self.layout.check_unchanged(self.files)  # the rows just used came from the files planned on
        if emitted < self.batches_per_epoch:
            # Cannot happen when the manifest is right; if it does, every rank must hear about it
            # rather than one rank silently running short and the others hanging in allreduce.
            raise DatasetError(
                f"rank {self.rank}: split {self.layout.name!r} delivered {stats.rows} rows in epoch {epoch}, "
                f"fewer than the {self.batches_per_epoch * self.batch_size} the manifest promises for rows "
                f"[{self.lo}, {self.hi}); the files changed after the manifest was written?")
        if stats.rows:
            in_range = np.flatnonzero(seen)
            stats.min_row, stats.max_row = int(in_range[0]) + self.lo, int(in_range[-1]) + self.lo

    def every_row(self) -> Iterator[dict]:
        """Each of this rank's rows once, in batches of ``batch_size`` and a partial last one.

        For validation, which runs no collective per batch and so, unlike training, needs no
        equal batch count across ranks: skipping rows there would bias the metrics.
        """
        import torch

        rows = 0
        encoded = self._shuffled_batches(0, EpochStats(epoch=0), keep_last=True)
        batches = self.decoder.batches(encoded, 0, augment=False)
        try:
            for arrays in batches:
                rows += len(arrays[ROW_INDEX])
                yield {name: torch.from_numpy(value) for name, value in arrays.items()}
        finally:
            batches.close()
            encoded.close()  # stops the reader now, not when the generator is collected
        self.layout.check_unchanged(self.files)
        if rows != self.hi - self.lo:
            raise DatasetError(
                f"rank {self.rank}: split {self.layout.name!r} delivered {rows} rows, not the {self.hi - self.lo} "
                f"the manifest promises for rows [{self.lo}, {self.hi}); the files changed after the manifest was written?")

    # -- internals --

    def _shuffled_batches(self, epoch: int, stats: EpochStats, keep_last: bool = False) -> Iterator[dict]:
        """``_batches``, with a storage error (a shard gone or unreadable mid-run, with either
        reader) as one line naming the path, not the reader's traceback."""
        where = posixpath.dirname(self.files[0].uri) if self.files else self.layout.name
        with storage_errors(f"rank {self.rank} reading split {self.layout.name!r}", where):
            try:
                yield from self._batches(epoch, stats, keep_last)
            except (DatasetError, OSError):
                # A file replaced or removed mid-pass fails the reader in its own words (rows
                # missing, a footer gone): a rewrite is said as one (exit 1), not as damage.
                self.layout.check_unchanged(self.files)
                raise

    def _batches(self, epoch: int, stats: EpochStats, keep_last: bool = False) -> Iterator[dict]:
        """Full batches of numpy arrays in this epoch's order (and the partial rest, if ``keep_last``).

        The shuffle buffers (``self.buffers``) are made in the arrow reader's own thread, or here for
        petastorm; each arrives already in batch order, so a batch is a slice of it (a view).
        """
        rng = np.random.default_rng(epoch_seed(self.seed, epoch, self.rank))
        reader = self._open_reader(epoch, rng)
        buffers = reader if self.reader == "arrow" else self.buffers.from_tables(reader, rng)
        size = self.batch_size
        last = None
        try:
            for last in buffers:
                stats.rows_read += last.rows_read
                for start in range(0, last.full, size):
                    yield batch_of({name: value[start:start + size] for name, value in last.arrays.items()},
                                   self.columns)
            if keep_last and last is not None and last.rest is not None:
                yield batch_of(last.rest, self.columns)
        finally:
            reader.stop()
            reader.join()

    def _open_reader(self, epoch: int, rng: np.random.Generator):
        self.layout.verify_files(self.files)  # both readers: no row of a damaged file is ever used
        uris, seed = [f.uri for f in self.files], epoch_seed(self.seed, epoch, self.rank)
        if self.reader == "arrow":
            from training.arrow_reader import ArrowRowGroupReader

            return ArrowRowGroupReader(uris, self.columns.stored, self.shuffle, seed, self.prefetch_row_groups,
                                       pipeline=lambda tables: self.buffers.from_tables(tables, rng),
                                       prefetch_bytes=self.prefetch_bytes)
        from training.petastorm_reader import open_petastorm_reader

        return open_petastorm_reader(uris, self.columns.stored, self.shuffle, seed, self.prefetch_row_groups,
                                     workers=self.reader_workers)

    def _mask(self, table):
        rows = table.column(ROW_INDEX).to_numpy()
        keep = (rows >= self.lo) & (rows < self.hi)
        if keep.all():
            return table
        import pyarrow as pa

        return table.filter(pa.array(keep))


def read_first_rows(layout: SplitLayout, columns: Columns, count: int) -> dict[str, np.ndarray]:
    """The split's first ``count`` rows in ``_row`` order, read with plain pyarrow (small reads only),
    encoded entries decoded."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables, have = [], 0
    for shard in layout.files:
        if have >= count:
            break
        if not shard.rows:
            continue
        layout.verify_files([shard])
        loc = resolve(shard.uri)
        with storage_errors(f"reading the first rows of split {layout.name!r}", shard.uri), \
                loc.fs.open(loc.path, "rb") as fh:
            # Only the row groups that hold the wanted rows: reading the whole shard made the
            # rank's peak memory grow with the shard size (benchmarks/memory_flat.py).
            for batch in pq.ParquetFile(fh).iter_batches(batch_size=count - have, columns=columns.stored):
                batch = batch.slice(0, count - have)
                tables.append(pa.Table.from_batches([batch]))
                have += batch.num_rows
                if have >= count:
                    break
    # Decoded as the loader decodes (never augmented): the reference predictions' inputs.
    return DecodeStage(list(columns.features), workers=1).decode_batch(
        batch_of(table_to_arrays(pa.concat_tables(tables), columns), columns))


__all__ = ["EpochStats", "RankLoader", "read_first_rows"]
