"""Each rank's input pipeline: published shards -> petastorm -> shuffled torch batches, with the
same number of batches on every rank.

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

Integrity: before a reader opens shard files it calls ``SplitLayout.verify_files`` with them,
which checks each file against the manifest's sha256 the first time this rank opens it in the
run (``data.verify``); any reader of shard files must call it.

Pinning: the driver records each file's version (``common.dataset.file_identity``: size and
mtime_ns locally, generation / ETag elsewhere) in the layout when it plans, beside the manifest's
fingerprint. ``verify_files`` compares it on every open (a stat per file, every rank, both
readers), a pass compares it again once it has read its rows, and ``check_manifest_unchanged``
re-reads the manifest's fingerprint (each epoch start, before publishing): a dataset rewritten
while the run reads it is a ``DatasetChangedError`` (exit 1) naming it, never rows of two
datasets in one model.

The order is a pure function of (seed, epoch, rank) when ``reader_workers == 1``, so a resume
position is just (epoch, step). This module owns the data path and nothing else: no model, no
Horovod, no Spark. Nothing here runs per row in Python.
"""

from __future__ import annotations

import logging
import posixpath
import re
import sys
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from common.errors import DatasetChangedError, DatasetError
from common.dataset import (ROW_INDEX, TEACHER_COLUMN, Manifest, current_fingerprint, file_identity,
                            verify_digest)
from common.storage import resolve, storage_errors

log = logging.getLogger("shardtrain.data")


# --- the arithmetic every rank agrees on ---------------------------------------------------------

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


# --- plain, picklable descriptions the driver builds from the manifest ------------------------

@dataclass(frozen=True)
class ShardFile:
    uri: str
    first_row: int  # the `_row` of its first row
    rows: int
    sha256: str = ""  # from the manifest; checked before the file's rows are used
    bytes: int = -1
    # The version the driver planned on (``file_identity``); () when unknown: not compared.
    identity: tuple = ()


@dataclass(frozen=True)
class SplitLayout:
    name: str
    rows: int
    files: tuple[ShardFile, ...]
    verify: bool = True  # data.verify: first_read (True) or never
    dataset_uri: str = ""  # the dataset the files belong to (named when one was rewritten)
    # Files this process has checked. A layout is unpickled once per rank per run, so this is
    # "first read of each file in a run"; on the driver it stays empty.
    verified: set = field(default_factory=set, compare=False, repr=False)

    @classmethod
    def from_manifest(cls, manifest: Manifest, split: str, verify: bool = True) -> "SplitLayout":
        files, first = [], 0
        for entry, uri in zip(manifest.files(split), manifest.file_uris(split)):
            files.append(ShardFile(uri=uri, first_row=first, rows=entry.rows, sha256=entry.sha256, bytes=entry.bytes,
                                   identity=_planned_identity(uri)))
            first += entry.rows
        rows = manifest.rows(split)
        if first != rows:
            raise DatasetError(f"{manifest.root.uri}: field 'splits.{split}.rows' is {rows} but its files hold "
                               f"{first} rows; the manifest is inconsistent, re-shard the data")
        return cls(name=split, rows=rows, files=tuple(files), verify=verify, dataset_uri=manifest.root.uri)

    def verify_files(self, files) -> None:
        """The integrity hook: every reader calls it with the files it is about to open. Each file
        must still be the version planned on (``check_unchanged``: every call); then it is checked
        against the manifest's sha256 the first time (a DatasetError, exit 2, names a damaged
        file); ``data.verify: never`` turns the sha256 check off."""
        self.check_unchanged(files)
        if not self.verify:
            return
        for shard in files:
            if shard.uri in self.verified or not shard.sha256:
                continue
            verify_digest(resolve(shard.uri), shard.sha256, shard.bytes)
            self.verified.add(shard.uri)

    def check_unchanged(self, files=None) -> None:
        """``files`` (default: all of the split's) are the versions the driver planned on, or a
        DatasetChangedError (exit 1) names the dataset and the first file that differs."""
        for shard in self.files if files is None else files:
            if not shard.identity:
                continue
            try:
                now = file_identity(resolve(shard.uri))
            except FileNotFoundError:
                raise rewritten(self.dataset_uri, f"{shard.uri} is gone") from None
            except OSError as exc:
                # Unreadable metadata is a storage failure, said as such by the reader's own error.
                log.warning("%s: cannot read the file's size and version (%s); not compared", shard.uri, exc)
                continue
            if now != shard.identity:
                raise rewritten(self.dataset_uri, f"{shard.uri} is now {_shown(now)}, planned on "
                                                  f"{_shown(shard.identity)}")

    def files_overlapping(self, lo: int, hi: int) -> list[ShardFile]:
        return [f for f in self.files if f.rows and f.first_row < hi and f.first_row + f.rows > lo]


def _planned_identity(uri: str) -> tuple:
    try:
        return file_identity(resolve(uri))
    except OSError:
        return ()  # gone or unreadable now: the sha256 check (or the reader) names the file


def _shown(identity: tuple) -> str:
    return ", ".join(f"{name} {value}" for name, value in identity)


def rewritten(dataset_uri: str, detail: str) -> DatasetChangedError:
    """The one message for a dataset replaced under a run (README: Troubleshooting)."""
    return DatasetChangedError(
        f"dataset {dataset_uri}: it was rewritten while training read it ({detail}); the run stopped and published "
        "nothing: train again on the dataset as it is now (a shard job's overwrite of a dataset that a training "
        "holds needs output.ignore_readers=true)")


def check_manifest_unchanged(dataset_uri: str, fingerprint: str) -> None:
    """The manifest at ``dataset_uri`` still has ``fingerprint`` (a committed, readable one), or a
    DatasetChangedError (exit 1). One small read: each epoch start, and before publishing."""
    now = current_fingerprint(resolve(dataset_uri))
    if now != fingerprint:
        detail = (f"its manifest's fingerprint is now {now[:12]}, planned on {fingerprint[:12]}" if now else
                  "its committed manifest is gone or unreadable")
        raise rewritten(dataset_uri, detail)


@dataclass(frozen=True)
class Columns:
    """Which stored columns make up a batch, and how (from the manifest's feature/label spec)."""

    numeric: tuple[str, ...]
    categorical: tuple[str, ...]
    arrays: tuple[tuple[str, tuple[int, ...]], ...]
    label: str
    label_dtype: str  # "int64" (classification) or "float32" (regression)
    # The teacher's soft targets (a batch's ``teacher``): their shape per row, () for regression;
    # None: not read (the run does not distill).
    teacher: tuple[int, ...] | None = None

    @property
    def stored(self) -> list[str]:
        teacher = [TEACHER_COLUMN] if self.teacher is not None else []
        return [*self.numeric, *self.categorical, *(n for n, _ in self.arrays), self.label, *teacher, ROW_INDEX]


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


# --- the loader -----------------------------------------------------------------------------------

class _ArrowTables:
    """petastorm results reader that hands over the worker's Arrow table as it is.

    petastorm's own reader converts every column through pandas and stacks list columns with
    ``np.vstack(column.tolist())`` (Python per row); we convert from Arrow buffers instead.
    """

    batched_output = True

    def read_next(self, workers_pool, schema, ngram):
        from petastorm.workers_pool import EmptyResultError

        try:
            return workers_pool.get_results()
        except EmptyResultError:
            raise StopIteration from None


class RankLoader:
    """One rank's batches for one epoch at a time: ``for batch in loader.epoch(e): ...``.

    A batch is a dict of torch tensors: ``numeric`` float32 [B, n_numeric], ``categorical`` int64
    [B, n_categorical], each array feature float32 [B, *shape], ``label`` (int64 or float32 [B]),
    ``teacher`` float32 [B, num_classes] or [B] when the columns include it, and ``_row`` int64 [B].
    """

    def __init__(self, layout: SplitLayout, columns: Columns, rank: int, world_size: int, batch_size: int,
                 grad_accum: int = 1, seed: int = 0, shuffle: bool = True, shuffle_buffer_rows: int = 65_536,
                 reader_workers: int = 1, prefetch_row_groups: int = 4, reader: str = "petastorm",
                 memory: "BufferMemory | None" = None):
        self.layout, self.columns = layout, columns
        self.rank, self.world_size = rank, world_size
        self.batch_size, self.grad_accum, self.seed, self.shuffle = batch_size, grad_accum, seed, shuffle
        self.shuffle_buffer_rows = max(shuffle_buffer_rows, batch_size)
        self.reader_workers, self.prefetch_row_groups = reader_workers, prefetch_row_groups
        self.reader = reader  # "petastorm" or "arrow" (training.arrow_reader): the same tables in the same order
        self.lo, self.hi = rank_row_range(layout.rows, rank, world_size)
        self.steps_per_epoch = steps_per_epoch(layout.rows, world_size, batch_size, grad_accum)
        self.batches_per_epoch = self.steps_per_epoch * grad_accum
        self.files = layout.files_overlapping(self.lo, self.hi)
        self.stats: list[EpochStats] = []
        # The shuffle buffers' memory, used again from epoch to epoch; loaders that never build
        # buffers at the same time (a rank's training and validation) can share one.
        self.memory = memory if memory is not None else BufferMemory()

    def epoch(self, epoch: int, skip_batches: int = 0) -> Iterator[dict]:
        """Exactly ``batches_per_epoch - skip_batches`` batches; the first ``skip_batches`` of the
        epoch's order are read but not built (resume)."""
        import torch

        stats = EpochStats(epoch=epoch)
        self.stats.append(stats)
        seen = np.zeros(self.hi - self.lo, dtype=bool)
        emitted = 0
        batches = self._shuffled_batches(epoch, stats)
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
            batches.close()  # stops the reader now, not when the generator is collected
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
        batches = self._shuffled_batches(0, EpochStats(epoch=0), keep_last=True)
        try:
            for arrays in batches:
                rows += len(arrays[ROW_INDEX])
                yield {name: torch.from_numpy(value) for name, value in arrays.items()}
        finally:
            batches.close()  # stops the reader now, not when the generator is collected
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

        The shuffle buffers (``_buffers``) are made in the arrow reader's own thread, or here for
        petastorm; each arrives already in batch order, so a batch is a slice of it (a view).
        """
        rng = np.random.default_rng(epoch_seed(self.seed, epoch, self.rank))
        reader = self._open_reader(epoch, rng)
        buffers = reader if self.reader == "arrow" else self._buffers(reader, rng)
        size = self.batch_size
        last = None
        try:
            for last in buffers:
                stats.rows_read += last.rows_read
                for start in range(0, last.full, size):
                    yield {name: value[start:start + size] for name, value in last.arrays.items()}
            if keep_last and last is not None and last.rest is not None:
                yield last.rest
        finally:
            reader.stop()
            reader.join()

    def _buffers(self, tables: Iterator, rng: np.random.Generator) -> Iterator["_Buffer"]:
        """Row groups -> shuffle buffers in batch order.

        Each row group is masked to this rank's rows. A buffer takes the rows the previous one
        left over (fewer than a batch), then rows of the row groups in order up to exactly
        ``shuffle_buffer_rows``: a row group larger than what is missing is cut (a zero-copy
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
            table = self._mask(table)
            while table.num_rows:
                missing = self.shuffle_buffer_rows - (len(rest[ROW_INDEX]) if rest else 0) - group_rows
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

    def _buffer(self, tables: list, rest: dict | None, rows_read: int, rng: np.random.Generator) -> "_Buffer":
        total = (len(rest[ROW_INDEX]) if rest else 0) + sum(table.num_rows for table in tables)
        order = rng.permutation(total) if self.shuffle and total else None
        # Converted into batch order once, for the whole buffer: a batch is then a slice of it.
        arrays = tables_to_arrays(tables, self.columns, lead=rest, order=order, empty=self.memory.empty)
        full = total // self.batch_size * self.batch_size
        return _Buffer(arrays=arrays, full=full, rows_read=rows_read,
                       rest={name: value[full:] for name, value in arrays.items()} if full < total else None)

    def _open_reader(self, epoch: int, rng: np.random.Generator):
        self.layout.verify_files(self.files)  # both readers: no row of a damaged file is ever used
        if self.reader == "arrow":
            from training.arrow_reader import ArrowRowGroupReader

            return ArrowRowGroupReader([f.uri for f in self.files], self.columns.stored, self.shuffle,
                                       epoch_seed(self.seed, epoch, self.rank), self.prefetch_row_groups,
                                       pipeline=lambda tables: self._buffers(tables, rng))
        from petastorm import make_batch_reader

        locations = [resolve(f.uri) for f in self.files]
        urls = [f"file://{loc.path}" if loc.scheme == "file" else loc.uri for loc in locations]
        # The same storage settings as everything else in shardtrain: petastorm would otherwise
        # build its own s3fs (ignoring SHARDTRAIN_S3_ENDPOINT / anonymous access) and use
        # libhdfs3 for hdfs:// where the rest of shardtrain uses pyarrow's libhdfs.
        storage = {}
        if any(loc.scheme == "s3" for loc in locations):
            # petastorm 0.12 calls the legacy pq.ParquetDataset(validate_schema=...), which pyarrow 14
            # accepts only with a legacy file system: wrap our s3fs in pyarrow's legacy S3FSWrapper.
            from pyarrow.filesystem import S3FSWrapper

            storage = {"filesystem": S3FSWrapper(locations[0].fs)}
        # Anchored patterns: petastorm treats schema_fields as regular expressions.
        fields = [re.escape(name) + "$" for name in self.columns.stored]
        reader = make_batch_reader(urls, schema_fields=fields, reader_pool_type="thread", hdfs_driver="libhdfs",
                                   **storage,
                                   workers_count=self.reader_workers, results_queue_size=self.prefetch_row_groups,
                                   shuffle_row_groups=self.shuffle, seed=epoch_seed(self.seed, epoch, self.rank),
                                   num_epochs=1)
        if not hasattr(reader, "_results_queue_reader") or not hasattr(reader, "ventilator"):
            reader.stop()  # pinned petastorm 0.12; fail loudly if that changes
            raise RuntimeError("unsupported petastorm version: Reader has no _results_queue_reader/ventilator")
        reader._results_queue_reader = _ArrowTables()
        # The ventilator keeps only workers + 2 row groups in flight and, when that many are out,
        # polls every 10 ms. A row group decodes in a few ms, so the worker sat idle waiting for
        # the next one; polling every 1 ms keeps it busy (the in-flight bound is unchanged).
        reader.ventilator._ventilation_interval = 0.001
        return reader

    def _mask(self, table):
        rows = table.column(ROW_INDEX).to_numpy()
        keep = (rows >= self.lo) & (rows < self.hi)
        if keep.all():
            return table
        import pyarrow as pa

        return table.filter(pa.array(keep))

@dataclass
class _Buffer:
    """One shuffle buffer of batch arrays in batch order, made off the training thread where the
    reader allows: batch k is rows [k * batch_size, (k + 1) * batch_size) of ``arrays``, for k
    below ``full / batch_size``; ``rest``: the rows after ``full`` (views), which open the next
    buffer, or end the epoch's rows for validation."""

    arrays: dict[str, np.ndarray]
    full: int
    rows_read: int  # rows decoded for it, including those masked out
    rest: dict[str, np.ndarray] | None


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


def table_to_arrays(table, columns: Columns) -> dict[str, np.ndarray]:
    """Arrow table of stored columns -> the batch arrays (columns stacked as the model wants them)."""
    return tables_to_arrays([table], columns)


def tables_to_arrays(tables: list, columns: Columns, lead: dict | None = None,
                     order: np.ndarray | None = None, empty=np.empty) -> dict[str, np.ndarray]:
    """The rows of ``lead`` (batch arrays: the rows a shuffle buffer carries over), then those of
    the Arrow ``tables``, as new batch arrays; in ``order`` (a permutation of those rows) if given.
    ``empty(shape, dtype)`` makes the arrays (``BufferMemory.empty`` reuses memory).

    The flat columns are stacked into [n, k] arrays, then gathered; array features, soft targets
    and scalars are gathered from the Arrow buffers (one copy when the rows are one row group's).
    """
    rows = (len(lead[ROW_INDEX]) if lead else 0) + sum(t.num_rows for t in tables)
    out: dict[str, np.ndarray] = {
        key: _in_order(_stacked(tables, names, dtype, lead and lead[key], empty), order, empty)
        for key, names, dtype in (("numeric", columns.numeric, np.float32),
                                  ("categorical", columns.categorical, np.int64))
    }
    lists = list(columns.arrays)
    scalars = [(columns.label, "label", np.dtype(columns.label_dtype)), (ROW_INDEX, ROW_INDEX, np.int64)]
    if columns.teacher:  # class probabilities: a list column
        lists.append((TEACHER_COLUMN, columns.teacher))
    elif columns.teacher is not None:  # a regression teacher's value
        scalars.append((TEACHER_COLUMN, TEACHER_COLUMN, np.float32))
    for name, shape in lists:
        parts = ([lead[name]] if lead else []) + [_list_column(table, name, shape) for table in tables]
        out[name] = _gathered(parts, (rows, *shape), np.float32, order, empty)
    for name, key, dtype in scalars:
        parts = ([lead[key]] if lead else []) + [chunk.to_numpy() for table in tables
                                                 for chunk in _non_null(table, name).chunks]
        out[key] = _gathered(parts, (rows,), dtype, order, empty)
    return out


def _in_order(values: np.ndarray, order: np.ndarray | None, empty=np.empty) -> np.ndarray:
    if order is None:
        return values
    # np.take along axis 0 is 2-3x faster than fancy indexing for [n, k] arrays. mode="clip"
    # (``order`` is a permutation, nothing to clip): with the default "raise", numpy gathers into
    # a temporary array first and copies that into ``out``.
    return np.take(values, order, axis=0, out=empty(values.shape, values.dtype), mode="clip")


def _gathered(parts: list[np.ndarray], shape: tuple, dtype, order: np.ndarray | None, empty=np.empty) -> np.ndarray:
    """``parts`` (consecutive blocks of rows) as one new array of ``shape``, rows in ``order`` if
    given. One row group's part (the usual case) is gathered straight from its Arrow buffer;
    several are joined first (gathering part by part measured no cheaper)."""
    out = empty(shape, dtype)
    if order is None:
        pos = 0
        for part in parts:
            out[pos:pos + len(part)] = part  # casts to the target dtype on the way
            pos += len(part)
        return out
    if len(parts) == 1:
        source = parts[0].astype(dtype, copy=False)
    else:  # joined in memory from ``empty`` too; "unsafe": the cast astype makes
        source = np.concatenate(parts, out=empty(shape, dtype), casting="unsafe")
    np.take(source, order, axis=0, out=out, mode="clip")  # "clip": see _in_order
    return out


# Rows per block of the transposition in ``_stacked``: a [k, block] slab stays in cache while it
# is written out row-major (a whole-buffer transpose took 1.4-1.8x as long).
_BLOCK_ROWS = 16_384


def _stacked(tables: list, names, dtype, lead: np.ndarray | None = None, empty=np.empty) -> np.ndarray:
    """``lead`` ([m, len(names)], if given), then columns ``names`` of ``tables``, as one
    C-contiguous [m + n, len(names)] array.

    Each block of rows is filled column by column into a small [k, block] array (contiguous
    writes) and transposed into place: about 3x cheaper than writing each column into a strided
    slice of the [n, k] array, and the block stays in cache.
    """
    pos = len(lead) if lead is not None else 0
    out = empty((pos + sum(t.num_rows for t in tables), len(names)), dtype)
    if not names:
        return out
    if pos:
        out[:pos] = lead
    block = np.empty((len(names), _BLOCK_ROWS), dtype=dtype)
    for table in tables:
        columns = [_column_values(table, name) for name in names]
        rows = table.num_rows
        for start in range(0, rows, _BLOCK_ROWS):
            size = min(_BLOCK_ROWS, rows - start)
            for j, values in enumerate(columns):
                block[j, :size] = values[start:start + size]  # casts to the target dtype on the way
            out[pos + start:pos + start + size] = block[:, :size].T
        pos += rows
    return out


def _column_values(table, name: str) -> np.ndarray:
    """A flat column as numpy (zero-copy for one chunk of a primitive type without nulls)."""
    column = _non_null(table, name)
    if column.num_chunks == 1:
        return column.chunk(0).to_numpy()
    return np.concatenate([chunk.to_numpy() for chunk in column.chunks]) if column.num_chunks else np.empty(0)


def _non_null(table, name: str):
    column = table.column(name)
    if column.null_count:
        raise DatasetError(f"column {name!r} has {column.null_count} null value(s) in a stored shard; "
                           "the manifest contract says stored features are already imputed")
    return column


def read_first_rows(layout: SplitLayout, columns: Columns, count: int) -> dict[str, np.ndarray]:
    """The split's first ``count`` rows in ``_row`` order, read with plain pyarrow (small reads only)."""
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
    return table_to_arrays(pa.concat_tables(tables), columns)


def _list_column(table, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A list<float> column -> float32 [n, *shape] straight from the flat values buffer."""
    width = int(np.prod(shape))
    array = table.column(name).combine_chunks()
    n = len(array)
    if array.null_count:
        raise DatasetError(f"array column {name!r} has {array.null_count} null row(s) in a stored shard")
    flat = array.flatten()  # respects the array's offset after slicing/filtering
    if hasattr(array, "offsets"):
        offsets = array.offsets.to_numpy()
        if not np.array_equal(np.diff(offsets), np.full(n, width)):
            raise DatasetError(f"array column {name!r}: every row must hold {width} values (shape {list(shape)})")
    values = flat.to_numpy(zero_copy_only=False)
    if values.dtype != np.float32:
        values = values.astype(np.float32)
    return values.reshape((n, *shape))


def columns_for(manifest: Manifest, teacher: bool = False) -> Columns:
    """The batch columns; ``teacher``: with the soft targets (the manifest must record a teacher)."""
    features, label = manifest.features, manifest.label
    return Columns(numeric=tuple(features.numeric), categorical=tuple(features.categorical),
                   arrays=tuple((name, tuple(shape)) for name, shape in features.arrays.items()),
                   label=label.name, label_dtype="int64" if label.classification else "float32",
                   teacher=manifest.teacher.shape if teacher else None)


__all__ = ["BufferMemory", "Columns", "check_manifest_unchanged", "rewritten", "EpochStats", "RankLoader", "ShardFile", "SplitLayout", "columns_for", "epoch_seed",
           "rank_row_range", "read_first_rows", "skipped_rows_per_epoch", "steps_per_epoch", "table_to_arrays",
           "tables_to_arrays"]
