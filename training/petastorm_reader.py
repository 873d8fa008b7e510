"""The ``data.reader: petastorm`` row-group reader: a rank's shard files read with petastorm's
batch reader, handing ``RankLoader`` one Arrow table per row group as it is.

It gives the same stream of tables as ``training.arrow_reader`` with one worker (one table per
row group, the row groups of the given files in file order, shuffled per epoch by petastorm's
ventilator with the given seed), so both readers give identical batches. Files are opened with
``common.storage``'s settings, not petastorm's own. This module owns opening that reader and
nothing else: which columns make a batch, shuffling rows and batching stay in ``training.data``.
petastorm is imported only when a reader is opened (the driver and the arrow path never import it).
"""

from __future__ import annotations

import re

from common.storage import resolve


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


def open_petastorm_reader(uris: list[str], columns: list[str], shuffle: bool, seed: int,
                          prefetch_row_groups: int = 4, workers: int = 1):
    """A started petastorm reader of the row groups of ``uris`` (columns ``columns``): iterate it
    for one Arrow table per row group; ``stop()`` and ``join()`` end it."""
    from petastorm import make_batch_reader

    locations = [resolve(uri) for uri in uris]
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
    fields = [re.escape(name) + "$" for name in columns]
    reader = make_batch_reader(urls, schema_fields=fields, reader_pool_type="thread", hdfs_driver="libhdfs",
                               **storage,
                               workers_count=workers, results_queue_size=prefetch_row_groups,
                               shuffle_row_groups=shuffle, seed=seed,
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


__all__ = ["open_petastorm_reader"]
