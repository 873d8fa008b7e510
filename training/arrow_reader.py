"""The ``data.reader: arrow`` row-group reader: a rank's shard files read with plain pyarrow, any
version, no petastorm.

It hands ``RankLoader`` the same stream of Arrow tables petastorm's batch reader does with one
worker: one table per row group, the row groups of the given files in file order, shuffled per
epoch with ``np.random.RandomState(seed).shuffle`` of that list (what petastorm's ventilator
does), so for the same seed, epoch and rank both readers give identical batches and a checkpoint
resumes on either. Files are opened through ``common.storage`` (local, s3, hdfs, dbfs).

One background thread decodes the row groups and, given ``pipeline``, a second one runs it over
that stream of tables (``training.data`` passes ``training.shuffle_buffers``: the mask to the
rank's rows, the grouping into shuffle buffers, their conversion to batch arrays and their
permutations): pyarrow and numpy release the GIL for the bulk of that work, so it overlaps the
training step instead of adding to it. Local files (and dbfs:/ through its mount) are opened by
path: pyarrow's own reads, no Python file object taking the GIL per read (a third less decode CPU,
benchmarks/RESULTS.md); other schemes through their ``common.storage`` file system. This module
owns reading row groups and running the caller's pipeline beside it, nothing else: which columns
make a batch (``training.columns``), shuffling rows (``training.shuffle_buffers``) and batching
(``training.data``) stay with the loader.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Iterator

import numpy as np

from common.manifest_builder import is_list_type
from common.errors import DatasetError

_DONE = object()


def row_group_order(row_groups_per_file: list[int], shuffle: bool, seed: int) -> list[tuple[int, int]]:
    """(file index, row group index) in reading order."""
    items = [(f, g) for f, count in enumerate(row_groups_per_file) for g in range(count)]
    if shuffle:
        # A list of objects shuffled by a legacy RandomState: the exact draws petastorm makes.
        np.random.RandomState(seed).shuffle(items)
    return items


class ArrowRowGroupReader:
    """Iterate to get one Arrow table per row group (or what ``pipeline`` makes of that stream);
    ``stop()`` and ``join()`` end it early.

    One thread decodes row groups, up to ``prefetch_row_groups`` ahead, and no more than
    ``prefetch_bytes`` of them (by the largest row group's uncompressed size in the files' footers;
    at least one). Given ``pipeline``, a
    second thread runs it over those tables and keeps one result ready: decoding the next row
    group, building the next buffer and the consumer's own work then run side by side.
    """

    def __init__(self, uris: list[str], columns: list[str], shuffle: bool, seed: int, prefetch_row_groups: int = 4,
                 pipeline: Callable[[Iterator], Iterator] | None = None, prefetch_bytes: int | None = None):
        import pyarrow.parquet as pq

        from common.storage import resolve

        self._uris = list(uris)
        self._handles, self._files = [], []
        try:
            for uri in uris:
                loc = resolve(uri)
                if loc.scheme == "file":
                    source = loc.path
                else:
                    source = loc.fs.open(loc.path, "rb")
                    self._handles.append(source)
                try:
                    self._files.append(pq.ParquetFile(source))
                except (FileNotFoundError, PermissionError, IsADirectoryError):
                    raise  # storage, not damage: the loader names the file (common.storage.storage_errors)
                except (OSError, ValueError) as exc:  # ArrowInvalid is a ValueError: no Parquet footer
                    raise DatasetError(f"{uri}: not a readable Parquet file ({exc}); the dataset is damaged, "
                                       "re-run the shard job") from None
        except BaseException:
            self._close()
            raise
        self._columns = list(columns)
        # pyarrow's threaded decode splits a row group by column: a gain for many flat columns,
        # but with a list column (an array feature, soft targets) it took 2-3x the CPU and wall
        # time of a plain read (benchmarks/RESULTS.md, "array columns"), so those read in one thread.
        schemas = [f.schema_arrow for f in self._files]  # made anew on each access: ~0.05 ms each
        self._use_threads = not any(is_list_type(schema.field(name).type)
                                    for schema in schemas for name in self._columns
                                    if schema.get_field_index(name) >= 0)
        self._order = row_group_order([f.metadata.num_row_groups for f in self._files], shuffle, seed)
        self._stopping = threading.Event()
        if prefetch_bytes:
            largest = max((f.metadata.row_group(g).total_byte_size for f in self._files
                           for g in range(f.metadata.num_row_groups)), default=0)
            prefetch_row_groups = min(prefetch_row_groups, prefetch_bytes // max(1, largest))
        self._tables_queue: queue.Queue = queue.Queue(maxsize=max(1, prefetch_row_groups))
        self._queue = self._tables_queue
        self._threads = [threading.Thread(target=self._decode, name="arrow-row-groups", daemon=True)]
        if pipeline is not None:
            self._queue = queue.Queue(maxsize=1)
            self._threads.append(threading.Thread(target=self._run_pipeline, args=(pipeline,),
                                                  name="arrow-pipeline", daemon=True))
        for thread in self._threads:
            thread.start()

    def __iter__(self) -> Iterator:
        return self._drain(self._queue)

    def stop(self) -> None:
        self._stopping.set()
        for q in {id(q): q for q in (self._tables_queue, self._queue)}.values():
            while True:  # unblock a thread waiting for room in the queue
                try:
                    q.get_nowait()
                except queue.Empty:
                    break

    def join(self) -> None:
        for thread in self._threads:
            thread.join()
        self._close()

    def _decode(self) -> None:
        self._feed(self._tables_queue, self._tables)

    def _run_pipeline(self, pipeline: Callable[[Iterator], Iterator]) -> None:
        self._feed(self._queue, lambda: pipeline(self._drain(self._tables_queue)))

    def _feed(self, target: queue.Queue, items: Callable[[], Iterator]) -> None:
        """Put what ``items()`` yields on ``target``, then the end (or the error, for the consumer's thread)."""
        try:
            for item in items():
                if not self._put(target, item):
                    return
            if not self._stopping.is_set():
                self._put(target, _DONE)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer's thread
            self._put(target, exc)

    def _drain(self, source: queue.Queue) -> Iterator:
        while True:
            try:
                item = source.get(timeout=0.1)
            except queue.Empty:
                if self._stopping.is_set():
                    return
                continue
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def _tables(self) -> Iterator:
        for file_index, group in self._order:
            if self._stopping.is_set():
                return
            try:
                table = self._files[file_index].read_row_group(group, columns=self._columns,
                                                               use_threads=self._use_threads)
            except Exception as exc:  # noqa: BLE001 - the same error, naming the file and row group
                raise DatasetError(f"{self._uris[file_index]}: row group {group} could not be read: "
                                   f"{type(exc).__name__}: {exc}") from exc
            yield table

    def _put(self, target: queue.Queue, item) -> bool:
        while not self._stopping.is_set():
            try:
                target.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _close(self) -> None:
        for parquet_file in self._files:
            parquet_file.close()  # the files pyarrow opened by path
        for handle in self._handles:
            handle.close()
        self._files, self._handles = [], []


__all__ = ["ArrowRowGroupReader", "row_group_order"]
