"""Decode CPU of one shard row group, as the shard writer lays it out against the alternatives, in one process.

    .venv/bin/python benchmarks/shard_decode.py [--rows 250000] [--repeats 12]

The table: 16 float32 features (standard normal, i.e. standardized continuous values), 2 int32
category codes, an int64 label and ``_row``. Each variant is written once under a temp
directory and its row group read ``--repeats`` times, single-threaded, alternating between
variants; CPU time (``time.process_time``), best and median, as ms per 1M rows, and the file's
size. One JSON line per variant, ``ratio`` = its best CPU / the shard writer's:
  - ``shard_writer``: pipelines/shard_writer.py as the job uses it (required columns, floats
    plain, ``_row`` delta, dictionaries for codes and labels, snappy except for float columns
    that snappy does not shrink on the file's first rows);
  - ``snappy_everywhere``: the same, but every column snappy (the writer before 2026-12-01 midday);
  - ``nullable``: the same as the writer, but the columns optional (definition levels decoded);
  - ``dictionary_everywhere``: required, snappy, a dictionary for every column (the 2026-11-30 writer).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pipelines.shard_writer import COMPRESSION_SAMPLE_ROWS, WRITER_OPTIONS, writer_options  # noqa: E402


def table(rows: int) -> pa.Table:
    rng = np.random.default_rng(0)
    cols = {f"x{j}": rng.standard_normal(rows, dtype=np.float32) for j in range(16)}
    cols.update({f"c{j}": rng.integers(0, 50, rows, dtype=np.int32) for j in range(2)})
    cols["label"] = rng.integers(0, 2, rows)
    cols["_row"] = np.arange(rows, dtype=np.int64)
    data = pa.table(cols)
    return data.cast(pa.schema([pa.field(f.name, f.type, nullable=False) for f in data.schema]))


def variants(data: pa.Table) -> dict[str, tuple[pa.Table, dict]]:
    sample = data.slice(0, COMPRESSION_SAMPLE_ROWS)
    ours = writer_options(data.schema, sample)
    nullable = data.cast(pa.schema([pa.field(f.name, f.type, nullable=True) for f in data.schema]))
    return {
        "shard_writer": (data, ours),
        "snappy_everywhere": (data, {**ours, "compression": WRITER_OPTIONS["compression"]}),
        "nullable": (nullable, writer_options(nullable.schema, nullable.slice(0, COMPRESSION_SAMPLE_ROWS))),
        "dictionary_everywhere": (data, {**WRITER_OPTIONS, "use_dictionary": True}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=250_000)
    parser.add_argument("--repeats", type=int, default=12)
    args = parser.parse_args()
    data = table(args.rows)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for name, (rows, options) in variants(data).items():
            paths[name] = os.path.join(tmp, f"{name}.parquet")
            pq.write_table(rows, paths[name], row_group_size=args.rows, **options)
        times: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.repeats):
            for name, path in paths.items():  # alternating, so load changes hit every variant alike
                parquet_file = pq.ParquetFile(path)
                start = time.process_time()
                parquet_file.read_row_group(0, use_threads=False)
                times[name].append(time.process_time() - start)
        per_million = 1e6 / args.rows * 1e3
        reference = min(times["shard_writer"])
        for name, path in paths.items():
            values = sorted(times[name])
            print(json.dumps({"variant": name, "rows": args.rows, "file_kb": os.path.getsize(path) // 1024,
                              "decode_ms_per_1m_rows_best": round(values[0] * per_million, 1),
                              "decode_ms_per_1m_rows_median": round(values[len(values) // 2] * per_million, 1),
                              "ratio": round(values[0] / reference, 2)}))


if __name__ == "__main__":
    main()
