"""Executor side of the shard job: the staging pass, and the shard files, byte-identically.

Two ``mapInArrow`` bodies, one per pass over the rows (pipelines/shard_job.py):

- ``stage_partition``: one partition of checked rows, all of one staging key (a split's range of
  buckets, or the bad rows), becomes one Parquet file of the staging directory; the summary of
  its rows (pipelines/summary.py) is taken on the way and reported with it.
- ``write_shards``: for each output file the driver planned, read the staged files that hold
  its buckets, sort the rows in rank order (the seeded shuffle key, then the tie-break), keep
  the file's block of ranks, encode them with the fitted statistics (``FeatureSpec``, the same
  code a loaded model applies) and write the file with fixed-size row groups; report what was
  written (path, rows, row-group sizes, bytes, sha256), one small record per file. For a small
  job the same tasks also write the quarantine's one file (``QuarantinePlan``), the bytes Spark's
  sort and ``write_partition`` give it, so that no job of its own is launched for it.

Runs on executors: it imports only numpy, pyarrow and common (never Spark, never the session),
and everything it needs arrives as plain picklable arguments. A retried or speculative task
writes a private temporary file and renames it, so a killed attempt leaves no half file under
the final name. A rerun writes the same shard bytes; a staged file may hold its rows in another
order (a shuffle's arrival order), which nothing downstream depends on.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import uuid
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from common.dataset import ROW_INDEX
from common.manifest_builder import is_list_type, value_type
from common.features import FeatureSpec
from common.storage import resolve, storage_errors
from common.tasks import label_task
from pipelines.summary import ScanSpec, chunks

TARGET_COLUMN = "_target"

# What each task reports back to the driver (a few bytes per file).
RESULT_SCHEMA = pa.schema([
    ("path", pa.string()),
    ("rows", pa.int64()),
    ("row_groups", pa.list_(pa.int64())),
    ("bytes", pa.int64()),
    ("sha256", pa.string()),
])
RESULT_DDL = "path STRING, rows BIGINT, row_groups ARRAY<BIGINT>, bytes BIGINT, sha256 STRING"

# Fixed writer settings: the same rows always give the same bytes (pyarrow writes no timestamps).
WRITER_OPTIONS = dict(compression="snappy", version="2.6", write_statistics=True)


def writer_options(schema: pa.Schema, sample: pa.Table | None = None) -> dict:
    """``WRITER_OPTIONS`` plus each column's encoding and compression, chosen by what it holds.

    - ``_row`` rises by one from row to row: delta encoding stores it in a few bytes per row
      group (4 MB of plain int64 per million rows otherwise).
    - Floating point (features, arrays, soft targets) is written plain: continuous values almost
      never repeat, so a dictionary page fills (1 MiB) and pyarrow falls back to plain after
      writing both.
    - Binary (an image's encoded bytes) is written plain, without min/max statistics: the values
      are distinct, and each row group's statistics would copy two of them into the footer.
    - Everything else (category codes, labels, reasons) gets a dictionary, where it pays.
    - Compression is snappy, except for a floating-point column that snappy does not shrink by
      ``SNAPPY_MIN_GAIN`` on ``sample`` (the file's first ``COMPRESSION_SAMPLE_ROWS`` rows, the
      same rows however the job ran): continuous values do not compress, and decompressing them
      anyway doubled their decode CPU on pyarrow 14 (benchmarks/RESULTS.md, "Required columns
      and uncompressed floats"). Columns that do compress (few distinct values, images with
      many zeros) keep snappy.

    Measured on 1M rows of 16 float32 features (benchmarks/RESULTS.md, "Shard encoding"): files
    35% smaller and half the decode CPU of dictionary-everywhere. Every Parquet reader in use
    (pyarrow, petastorm, Spark 3.5+) reads these encodings.
    """
    delta = {f.name: "DELTA_BINARY_PACKED" for f in schema if f.name == ROW_INDEX and pa.types.is_integer(f.type)}
    # Encoded bytes (images) are written plain too: a dictionary of distinct images only doubles them.
    dictionary = [f.name for f in schema if f.name not in delta and not pa.types.is_floating(value_type(f.type))
                  and not pa.types.is_binary(f.type)]
    # No min/max statistics of encoded bytes: each row group's footer would hold two whole images.
    statistics = [f.name for f in schema if not pa.types.is_binary(f.type)]
    options = {**WRITER_OPTIONS, "use_dictionary": dictionary, "column_encoding": delta or None,
               "write_statistics": statistics if len(statistics) < len(schema) else True}
    if sample is not None and sample.num_rows:
        codec = pa.Codec(WRITER_OPTIONS["compression"])
        options["compression"] = {
            f.name: "NONE" if pa.types.is_floating(value_type(f.type)) and not _compresses(sample.column(f.name), codec)
            else WRITER_OPTIONS["compression"] for f in schema}
    return options


COMPRESSION_SAMPLE_ROWS = 4096
SNAPPY_MIN_GAIN = 0.1


def _compresses(column: pa.ChunkedArray, codec: pa.Codec) -> bool:
    """Whether ``codec`` shrinks the column's values (the sample's) by at least SNAPPY_MIN_GAIN."""
    values = column.combine_chunks()
    while is_list_type(values.type):
        values = values.flatten()
    raw = np.ascontiguousarray(values.to_numpy(zero_copy_only=False)).tobytes()
    return len(codec.compress(raw)) <= (1 - SNAPPY_MIN_GAIN) * len(raw) if raw else True


def write_partition(batches: Iterator[pa.RecordBatch], *, root_uri: str, targets: list[str],
                    schema: pa.Schema, rows_per_row_group: int) -> Iterator[pa.RecordBatch]:
    """mapInArrow body for a partition Spark placed (the quarantine): its batches (rows of one
    output file, in file order, with ``_target`` naming it) -> that file under ``root_uri``;
    yields its record. A partition with rows of two files fails the task: the driver's partition
    keys would be wrong."""
    batches = (batch for batch in batches if batch.num_rows)
    first = next(batches, None)
    if first is None:
        return  # an empty partition writes nothing; the driver checks every file arrived
    target = first.column(first.schema.get_field_index(TARGET_COLUMN))[0].as_py()

    def tables() -> Iterator[pa.Table]:
        for batch in itertools.chain([first], batches):
            table = pa.Table.from_batches([batch])
            lo, hi = pc.min_max(table.column(TARGET_COLUMN)).values()
            if lo.as_py() != target or hi.as_py() != target:
                raise RuntimeError(f"partition holds rows of more than one output file ({targets[target]!r} "
                                   "and another); the driver's partition keys are wrong")
            yield table.drop([TARGET_COLUMN])

    yield _write_file(tables(), resolve(root_uri), targets[target], schema, rows_per_row_group)


def _write_file(tables: Iterator[pa.Table], root, path: str, schema: pa.Schema,
                rows_per_row_group: int) -> pa.RecordBatch:
    """``tables`` (one file's rows in file order) as the Parquet file ``path`` under ``root``,
    written atomically in row groups of ``rows_per_row_group``; returns the file's record."""
    groups: list[int] = []
    with _atomic_file(root, path) as sink:
        writer = None
        pending: list[pa.Table] = []
        pending_rows = 0
        try:
            for table in tables:
                pending.append(table.cast(schema))
                pending_rows += table.num_rows
                if writer is None and pending_rows >= COMPRESSION_SAMPLE_ROWS:
                    writer = _open_writer(sink, schema, pending)
                while writer is not None and pending_rows >= rows_per_row_group:
                    pending, pending_rows = _write_group(writer, pending, rows_per_row_group, groups)
            if writer is None:  # fewer rows than the sample
                writer = _open_writer(sink, schema, pending)
            while pending_rows >= rows_per_row_group:
                pending, pending_rows = _write_group(writer, pending, rows_per_row_group, groups)
            if pending_rows:
                _write_group(writer, pending, pending_rows, groups)
        finally:
            if writer is not None:
                writer.close()
    size, digest = file_digest(root.fs, root.join(path).path)
    return pa.RecordBatch.from_pylist(
        [{"path": path, "rows": sum(groups), "row_groups": groups, "bytes": size, "sha256": digest}],
        schema=RESULT_SCHEMA)


@contextlib.contextmanager
def _atomic_file(root, path: str):
    """A binary sink for ``path`` (under ``root``) that appears under that name only once the
    block ends without an error: it is written under a private temporary name, then renamed."""
    final = root.join(path)
    tmp = f"{final.path}.tmp-{uuid.uuid4().hex}"
    # On an executor: a full disk or a refused write fails as one line naming the file (the driver
    # shows it as it is: common.spark.spark_errors), not as the worker's traceback.
    with storage_errors("writing", final.uri):
        root.fs.makedirs(final.path.rsplit("/", 1)[0], exist_ok=True)
        sink = root.fs.open(tmp, "wb")
        try:
            yield sink
            sink.close()
            root.fs.mv(tmp, final.path)
        except BaseException:
            with contextlib.suppress(Exception):  # closing flushes, which fails again on a full disk
                sink.close()
            with contextlib.suppress(Exception):  # the staging directory it is in goes as a whole anyway
                if root.fs.exists(tmp):
                    root.fs.rm(tmp)
            raise


def _open_writer(sink, schema: pa.Schema, pending: list[pa.Table]) -> pq.ParquetWriter:
    """The file's writer, its compression chosen on its first COMPRESSION_SAMPLE_ROWS rows."""
    sample = pa.concat_tables(pending).slice(0, COMPRESSION_SAMPLE_ROWS) if pending else None
    return pq.ParquetWriter(sink, schema, **writer_options(schema, sample))


def _write_group(writer: pq.ParquetWriter, pending: list[pa.Table], rows: int, groups: list[int]):
    table = pa.concat_tables(pending)
    writer.write_table(table.slice(0, rows), row_group_size=rows)
    groups.append(rows)
    rest = table.slice(rows)
    return ([rest] if rest.num_rows else []), rest.num_rows


# ---- the staging pass ----

STAGE_COLUMN = "_stage"
STAGE_RESULT_SCHEMA = pa.schema([("stage", pa.int32()), ("path", pa.string()), ("rows", pa.int64()),
                                 ("summary", pa.binary())])
STAGE_RESULT_DDL = "stage INT, path STRING, rows BIGINT, summary BINARY"
# Staged rows are read once more, by this module, and removed: written for speed (no
# compression, no dictionaries, no statistics), in row groups of this many rows.
STAGE_CHUNK_ROWS = 1 << 16
STAGE_WRITER_OPTIONS = dict(compression="NONE", use_dictionary=False, write_statistics=False, version="2.6")


def stage_partition(batches: Iterator[pa.RecordBatch], *, root_uri: str, directory: str,
                    scan: ScanSpec) -> Iterator[pa.RecordBatch]:
    """mapInArrow body of the staging pass: one partition of checked rows, all with one
    ``_stage`` key, -> ``directory/part-<key>.parquet`` under ``root_uri`` (without the key
    column), and one record: the key, the file, its rows, and its rows' summary (``scan``).

    The rows arrive in no particular order (a shuffle's reduce side), which nothing downstream
    depends on: the summary is exact, and the shard files are sorted by content."""
    batches = (batch for batch in batches if batch.num_rows)
    first = next(batches, None)
    if first is None:
        return  # no rows carry this key: no file
    stage = pa.Table.from_batches([first]).column(STAGE_COLUMN)[0].as_py()
    path = f"{directory}/part-{stage:05d}.parquet"
    scanner = scan.scanner()
    root = resolve(root_uri)
    rows = 0
    with _atomic_file(root, path) as sink:
        writer = None
        try:
            for chunk in chunks(itertools.chain([first], batches), STAGE_CHUNK_ROWS):
                lo, hi = pc.min_max(chunk.column(STAGE_COLUMN)).values()
                if lo.as_py() != stage or hi.as_py() != stage:
                    raise RuntimeError(f"a staging partition holds rows of keys {lo} and {hi}; the driver's "
                                       "partition keys are wrong")
                chunk = chunk.drop([STAGE_COLUMN])
                scanner.add(chunk)
                if writer is None:
                    writer = pq.ParquetWriter(sink, chunk.schema, **STAGE_WRITER_OPTIONS)
                writer.write_table(chunk, row_group_size=chunk.num_rows)
                rows += chunk.num_rows
        finally:
            if writer is not None:
                writer.close()
    yield pa.RecordBatch.from_pylist([{"stage": stage, "path": path, "rows": rows, "summary": scanner.result()}],
                                     schema=STAGE_RESULT_SCHEMA)


# ---- the shard files ----

@dataclass(frozen=True)
class ShardPlan:
    """One output file, as the driver places it from the summary's counts."""

    target: int                # index into the targets (the file's path)
    buckets: tuple[int, int]   # the first and last bucket of its split whose ranks meet its block
    first_rank: int            # the rank of the first bucket's first row
    start: int                 # its block of ranks: [start, start + rows)
    rows: int
    inputs: tuple[str, ...]    # the staged files (under the staging root) that hold those buckets
    bucket_rows: int           # the clean rows in those buckets, as the summary counted them


@dataclass(frozen=True)
class Encoding:
    """How each stored column comes from the staged ones: (stored name, how, staged column),
    how = ``feature`` (stored as its kind stores it: ``FeatureSpec`` of ``features``, the manifest's),
    ``label`` (nulls become the task's ``missing_label``, ``common.tasks``) or ``copy``; ``_row`` is the rank."""

    features: dict
    columns: tuple[tuple[str, str, str], ...]
    task: str = "classification"


PLACEMENT_COLUMNS = ("_bucket", "_shuffle", "_tiebreak")
# The batches the writer is given (Spark's Arrow batch size, so files match those of the job
# when Spark delivered the rows).
WRITE_BATCH_ROWS = 10_000


@dataclass(frozen=True)
class QuarantinePlan:
    """The quarantine as one file, written by a task of the shard files' job: its bad rows are
    all in the staged files ``inputs``, ``rows`` of them."""

    path: str
    inputs: tuple[str, ...]
    rows: int
    schema: pa.Schema
    rows_per_row_group: int


def write_shards(tasks: Iterator[pa.RecordBatch], *, root_uri: str, plans: list[ShardPlan], targets: list[str],
                 encoding: Encoding, schema: pa.Schema, rows_per_row_group: int,
                 assignments: list[tuple[int, ...]], quarantine: QuarantinePlan | None = None
                 ) -> Iterator[pa.RecordBatch]:
    """mapInArrow body over task indexes (one column): task t writes the files ``assignments[t]``
    names, each planned file read, ranked, encoded and written (see the module docstring), and
    index ``len(plans)`` the quarantine's file; yields one record per file."""
    spec = FeatureSpec(encoding.features)
    staged = sorted({source for _, _, source in encoding.columns})
    for batch in tasks:
        for task in batch.column(0).to_pylist():
            for target in assignments[task]:
                if target == len(plans):
                    yield write_quarantine_file(root_uri, quarantine)
                    continue
                plan = plans[target]
                rows = _placed_rows(root_uri, plan, staged, targets[target])
                yield _write_table(_encoded(rows, spec, encoding, plan.start), root_uri, targets[target], schema,
                                   rows_per_row_group)


def _write_table(table: pa.Table, root_uri: str, path: str, schema: pa.Schema,
                 rows_per_row_group: int) -> pa.RecordBatch:
    # Fixed batches: the Parquet writer's page boundaries follow the batches it is given, and
    # these are the ones Spark's Arrow transfer gives ``write_partition`` (WRITE_BATCH_ROWS).
    batches = table.combine_chunks().to_batches(max_chunksize=WRITE_BATCH_ROWS)
    return _write_file((pa.Table.from_batches([batch]) for batch in batches), resolve(root_uri), path, schema,
                       rows_per_row_group)


QUARANTINE_SOURCES = {"reason": "_reason", "source": "_source", "raw": "_raw"}


def write_quarantine_file(root_uri: str, plan: QuarantinePlan) -> pa.RecordBatch:
    """The quarantine's one file from the staged bad rows: sorted by (reason, source, raw) as
    Spark's ``sortWithinPartitions`` sorts them (byte order, nulls first; rows equal in all three
    are identical, so their order among themselves changes no byte), in Spark's Arrow batches."""
    root = resolve(root_uri)
    parts = []
    for path in plan.inputs:
        with root.fs.open(root.join(path).path, "rb") as source:
            parts.append(pq.read_table(source, columns=list(QUARANTINE_SOURCES.values())))
    rows = pa.concat_tables(parts) if parts else None
    if rows is None or rows.num_rows != plan.rows:
        raise RuntimeError(f"{plan.path}: the staged files hold {rows.num_rows if rows else 0} bad rows where the count "
                           f"found {plan.rows}; the staging directory changed while the job ran, nothing was published")
    rows = rows.rename_columns(list(QUARANTINE_SOURCES))
    order = pc.sort_indices(rows, sort_keys=[(c, "ascending") for c in QUARANTINE_SOURCES], null_placement="at_start")
    return _write_table(rows.take(order), root_uri, plan.path, plan.schema, plan.rows_per_row_group)


def _placed_rows(root_uri: str, plan: ShardPlan, columns: list[str], target: str) -> pa.Table:
    """The file's rows in rank order: its buckets' rows from the staged files, sorted by the
    shuffle key as an unsigned number (its top bits are the bucket), then the tie-break; the
    first bucket's first row has rank ``first_rank``, and the file keeps its block.

    Rows equal in both keys are, short of a 128-bit collision, identical input rows, hence
    identical output rows: their order among themselves cannot change a byte."""
    root = resolve(root_uri)
    lo, hi = plan.buckets
    parts = []
    for path in plan.inputs:  # batch by batch: only this file's buckets are kept in memory
        with root.fs.open(root.join(path).path, "rb") as source:
            for batch in pq.ParquetFile(source).iter_batches(batch_size=STAGE_CHUNK_ROWS,
                                                             columns=[*columns, *PLACEMENT_COLUMNS]):
                bucket = batch.column(batch.schema.get_field_index("_bucket"))
                parts.append(batch.filter(pc.and_(pc.greater_equal(bucket, lo), pc.less_equal(bucket, hi))))
    rows = _wide_lists(pa.Table.from_batches(parts)) if parts else None
    found = rows.num_rows if rows is not None else 0
    if found != plan.bucket_rows or plan.start - plan.first_rank + plan.rows > found:
        raise RuntimeError(f"{target}: the staged files hold {found} rows of buckets {lo}-{hi} where the count found "
                           f"{plan.bucket_rows}; the staging directory changed while the job ran, nothing was published")
    offset = plan.start - plan.first_rank
    return rows.take(rank_order(rows.column("_shuffle").to_numpy(), rows.column("_tiebreak").to_numpy())
                     [offset:offset + plan.rows])


def _wide_lists(table: pa.Table) -> pa.Table:
    """List columns with 64-bit offsets: a shard's array feature can hold more than 2^31 values
    in all (``take`` and ``combine_chunks`` join chunks into one array). The writer casts each
    batch back to the stored type, so the file does not change."""
    schema = pa.schema([f.with_type(pa.large_list(f.type.value_field)) if pa.types.is_list(f.type) else f
                        for f in table.schema])
    return table if schema.equals(table.schema) else table.cast(schema)


def rank_order(shuffle: np.ndarray, tiebreak: np.ndarray) -> np.ndarray:
    """The permutation that sorts rows by (shuffle as unsigned 64-bit, tiebreak as signed).
    Equal shuffle keys are rare (duplicate rows, or a 64-bit collision), so the one-key sort
    (several times faster than a two-key lexsort here) is checked and redone only if it has any."""
    keys = shuffle.view(np.uint64)
    order = np.argsort(keys)
    ordered = keys[order]
    if len(ordered) > 1 and (ordered[1:] == ordered[:-1]).any():
        order = np.lexsort((tiebreak, keys))
    return order


def _encoded(rows: pa.Table, spec: FeatureSpec, encoding: Encoding, first_rank: int) -> pa.Table:
    columns = {}
    for name, how, source in encoding.columns:
        values = rows.column(source).combine_chunks()
        if how == "feature":
            columns[name] = spec.stored_values(name, values)
        elif how == "label" and values.null_count:  # a transfer row's null label: the marker the readers pass on
            columns[name] = pc.fill_null(values, pa.scalar(label_task(encoding.task).missing_label, values.type))
        else:
            columns[name] = values
    columns[ROW_INDEX] = np.arange(first_rank, first_rank + rows.num_rows, dtype=np.int64)
    return pa.table(columns)


def write_empty(root_uri: str, path: str, schema: pa.Schema) -> dict:
    """An empty file with the schema (so an empty quarantine still reads as a dataset)."""
    root = resolve(root_uri)
    loc = root.join(path)
    root.fs.makedirs(loc.path.rsplit("/", 1)[0], exist_ok=True)
    with root.fs.open(loc.path, "wb") as sink:
        pq.ParquetWriter(sink, schema, **writer_options(schema)).close()
    size, digest = file_digest(root.fs, loc.path)
    return {"path": path, "rows": 0, "row_groups": [], "bytes": size, "sha256": digest}


def file_digest(fs, path: str) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with fs.open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()
