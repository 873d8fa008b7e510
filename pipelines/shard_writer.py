"""Executor side of the shard job: write one Spark partition as one Parquet file, byte-identically.

The driver arranges that each partition holds the rows of exactly one output file, sorted in file
order, with an int ``_target`` column naming the file (an index into ``targets``). This module
turns that stream of Arrow batches into a Parquet file with fixed-size row groups and reports
what it wrote (path, rows, row-group sizes, bytes, sha256), one small record per file.

Runs on executors: it imports only pyarrow and common.storage (never Spark, never the
session), and everything it needs arrives as plain picklable arguments. A retried or speculative
task writes a private temporary file and renames it, so a killed attempt leaves no half file
under the final name and a rerun writes the same bytes.
"""

from __future__ import annotations

import hashlib
import uuid
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from common.dataset import ROW_INDEX, is_list_type, value_type
from common.storage import resolve

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
    dictionary = [f.name for f in schema if f.name not in delta and not pa.types.is_floating(value_type(f.type))]
    options = {**WRITER_OPTIONS, "use_dictionary": dictionary, "column_encoding": delta or None}
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
                    schema: pa.Schema, rows_per_row_group: int,
                    consecutive: str | None = None, first_values: list[int] | None = None) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: the partition's batches -> one file under ``root_uri``; yields its record.

    ``consecutive``: a column whose value must rise by exactly one from each row to the next (the
    shards' ``_row``), so a partition that arrives out of order fails instead of writing it;
    ``first_values``: per target, the value its first row must have (else any).
    """
    writer = None
    target = None
    pending: list[pa.Table] = []
    pending_rows = 0
    groups: list[int] = []
    root = resolve(root_uri)
    tmp_path = final_path = None
    sink = None
    next_value = None
    try:
        for batch in batches:
            if batch.num_rows == 0:
                continue
            table = pa.Table.from_batches([batch])
            ids = table.column(TARGET_COLUMN)
            first = ids[0].as_py()
            if target is None:
                target = first
                final_path = root.join(targets[target]).path
                tmp_path = f"{final_path}.tmp-{uuid.uuid4().hex}"
                root.fs.makedirs(root.join(targets[target]).path.rsplit("/", 1)[0], exist_ok=True)
                sink = root.fs.open(tmp_path, "wb")
            lo, hi = pc.min_max(ids).values()
            if lo.as_py() != target or hi.as_py() != target:
                raise RuntimeError(f"partition holds rows of more than one output file ({targets[target]!r} and "
                                   "another); the driver's partition keys are wrong")
            if consecutive is not None:
                if next_value is None and first_values is not None:
                    next_value = first_values[target]
                next_value = _check_consecutive(table.column(consecutive), next_value, targets[target])
            pending.append(table.drop([TARGET_COLUMN]).cast(schema))
            pending_rows += table.num_rows
            if writer is None and pending_rows >= COMPRESSION_SAMPLE_ROWS:
                writer = _open_writer(sink, schema, pending)
            while writer is not None and pending_rows >= rows_per_row_group:
                pending, pending_rows = _write_group(writer, pending, rows_per_row_group, groups)
        if target is None:
            return  # an empty partition writes nothing; the driver checks every file arrived
        if writer is None:  # fewer rows than the sample
            writer = _open_writer(sink, schema, pending)
        while pending_rows >= rows_per_row_group:
            pending, pending_rows = _write_group(writer, pending, rows_per_row_group, groups)
        if pending_rows:
            _write_group(writer, pending, pending_rows, groups)
        writer.close()
        writer = None
        sink.close()
        sink = None
        root.fs.mv(tmp_path, final_path)
        tmp_path = None
    finally:
        if writer is not None:
            writer.close()
        if sink is not None:
            sink.close()
        if tmp_path is not None and root.fs.exists(tmp_path):
            root.fs.rm(tmp_path)
    size, digest = file_digest(root.fs, final_path)
    yield pa.RecordBatch.from_pylist(
        [{"path": targets[target], "rows": sum(groups), "row_groups": groups, "bytes": size, "sha256": digest}],
        schema=RESULT_SCHEMA)


def _open_writer(sink, schema: pa.Schema, pending: list[pa.Table]) -> pq.ParquetWriter:
    """The file's writer, its compression chosen on its first COMPRESSION_SAMPLE_ROWS rows."""
    sample = pa.concat_tables(pending).slice(0, COMPRESSION_SAMPLE_ROWS) if pending else None
    return pq.ParquetWriter(sink, schema, **writer_options(schema, sample))


def _check_consecutive(values: pa.ChunkedArray, expected: int | None, target: str) -> int:
    """``values`` must be expected, expected + 1, ... (any start for the first batch); returns the next."""
    array = values.to_numpy()
    start = int(array[0]) if expected is None else expected
    if array[0] != start or (len(array) > 1 and not (np.diff(array) == 1).all()):
        raise RuntimeError(f"rows for {target!r} arrived out of order (row index {int(array[0])} where {start} was "
                           "next, or a gap within a batch); nothing was published")
    return start + len(array)


def _write_group(writer: pq.ParquetWriter, pending: list[pa.Table], rows: int, groups: list[int]):
    table = pa.concat_tables(pending)
    writer.write_table(table.slice(0, rows), row_group_size=rows)
    groups.append(rows)
    rest = table.slice(rows)
    return ([rest] if rest.num_rows else []), rest.num_rows


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
