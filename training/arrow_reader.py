"""The ``data.reader: arrow`` row-group reader: a rank's shard files read with plain pyarrow, any
version, no petastorm.

It hands ``RankLoader`` the same stream of Arrow tables petastorm's batch reader does with one
worker: one table per row group, the row groups of the given files in file order, shuffled per
epoch with ``np.random.RandomState(seed).shuffle`` of that list (what petastorm's ventilator
does), so for the same seed, epoch and rank both readers give identical batches and a checkpoint
resumes on either. Files are opened through ``common.storage`` (local, s3, hdfs, dbfs).

One background thread decodes up to ``prefetch_row_groups`` row groups ahead of the training
step and, given ``prepare``, also runs it on each table there (``training.data`` passes the mask
to the rank's rows and the conversion to batch arrays): pyarrow and numpy release the GIL for the
bulk of that work, so it overlaps the training step instead of adding to it. Local files (and
dbfs:/ through its mount) are opened by path: pyarrow's own reads, no Python file object taking
the GIL per read (a third less decode CPU, benchmarks/RESULTS.md); other schemes through their
``common.storage`` file system. This module owns reading row
groups, nothing else: which columns make a batch, shuffling rows and batching stay in
``training.data``.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Iterator

import numpy as np

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
    """Iterate to get one Arrow table per row group (or what ``prepare`` makes of it, computed in
    the reader's thread); ``stop()`` and ``join()`` end it early."""

    def __init__(self, uris: list[str], columns: list[str], shuffle: bool, seed: int, prefetch_row_groups: int = 4,
                 prepare: Callable | None = None):
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
        self._prepare = prepare
        self._order = row_group_order([f.metadata.num_row_groups for f in self._files], shuffle, seed)
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, prefetch_row_groups))
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._decode, name="arrow-row-groups", daemon=True)
        self._thread.start()

    def __iter__(self) -> Iterator:
        while True:
            item = self._queue.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def stop(self) -> None:
        self._stopping.set()
        while True:  # unblock a decoder waiting for room in the queue
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break

    def join(self) -> None:
        self._thread.join()
        self._close()

    def _decode(self) -> None:
        try:
            for file_index, group in self._order:
                if self._stopping.is_set():
                    return
                try:
                    # use_threads: the columns decode in parallel on pyarrow's CPU pool when cores are free.
                    table = self._files[file_index].read_row_group(group, columns=self._columns, use_threads=True)
                except Exception as exc:  # noqa: BLE001 - the same error, naming the file and row group
                    raise DatasetError(f"{self._uris[file_index]}: row group {group} could not be read: "
                                       f"{type(exc).__name__}: {exc}") from exc
                if not self._put(self._prepare(table) if self._prepare else table):
                    return
            self._put(_DONE)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer's thread
            self._put(exc)

    def _put(self, item) -> bool:
        while not self._stopping.is_set():
            try:
                self._queue.put(item, timeout=0.1)
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
