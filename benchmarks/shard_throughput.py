"""Shard job throughput vs a single-process pyarrow rewrite of the same data, measured side by side.

    .venv/bin/python benchmarks/shard_throughput.py --rows 1000000            # 1M rows
    .venv/bin/python benchmarks/shard_throughput.py --rows 1000000 10000000   # and 10M

For each size: generate a Parquet dataset (4 numeric, 2 categorical, an 8-float array, a binary
label, 0.01% bad rows) with Spark, then time
  - ``spark``: run_shard_job on local[N] (quarantine, split, train-only statistics, vocabularies,
    balanced seeded-shuffle shards, checksums, manifest, atomic publish);
  - ``pyarrow``: one Python process doing the comparable work on the same files: read, drop bad
    rows, split by a hash of id, mean/std and vocabularies on train, standardize and index,
    seeded shuffle, write num_shards Parquet files per split with the same row-group size.
It prints one JSON line per size; ``ratio`` = spark rows/s / pyarrow rows/s (> 1: Spark is faster).
MB/s is input bytes (the source Parquet files) per second.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.config import from_dict  # noqa: E402
from pipelines.generate import generate_dataset  # noqa: E402
from pipelines.shard_config import ShardConfig  # noqa: E402
from pipelines.shard_job import run_shard_job  # noqa: E402

ROWS_PER_ROW_GROUP = 50_000


def spark_session(master: str):
    from common.config import SparkConfig
    from common.spark import get_or_create_session

    conf = {"spark.sql.shuffle.partitions": 8, "spark.ui.enabled": False, "spark.driver.memory": "4g"}
    return get_or_create_session(SparkConfig(master=master, app_name="shard-throughput", conf=conf), log_level="ERROR")


def input_bytes(path: str) -> int:
    return sum(p.stat().st_size for p in Path(path).glob("*.parquet"))


def time_spark(spark, data, out: str, num_shards: int) -> float:
    cfg = from_dict(ShardConfig, data.shard_config(out, output={"num_shards": num_shards, "mode": "overwrite",
                                                                "rows_per_row_group": ROWS_PER_ROW_GROUP},
                                                   quality={"max_bad_fraction": 0.01}))
    start = time.perf_counter()
    result = run_shard_job(spark, cfg)
    elapsed = time.perf_counter() - start
    assert result.manifest.data["accounting"]["input_rows"] == data.rows
    return elapsed


def splitmix64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def time_pyarrow(data, out: str, num_shards: int) -> float:
    """The comparable single-process pipeline; returns seconds."""
    start = time.perf_counter()
    table = pq.read_table(data.path)
    label = table.column("label")
    lengths = pc.list_value_length(table.column("image"))
    ok = pc.and_(pc.and_(pc.is_valid(label), pc.and_(pc.greater_equal(label, 0), pc.less(label, 2))),
                 pc.and_(pc.equal(lengths, 8), pc.invert(pc.is_inf(pc.fill_null(table.column("x0"), 0.0)))))
    table = table.filter(ok)
    u = splitmix64(table.column("id").to_numpy()) >> np.uint64(11)
    u = u.astype(np.float64) / float(1 << 53)
    split = np.where(u < 0.8, 0, np.where(u < 0.9, 1, 2))
    train = table.filter(pa.array(split == 0))
    columns = {}
    for name in data.numeric:
        col = train.column(name).to_numpy(zero_copy_only=False)
        mean, std = np.nanmean(col), np.nanstd(col)
        full = table.column(name).to_numpy(zero_copy_only=False)
        columns[name] = ((np.where(np.isnan(full), mean, full) - mean) / (std or 1.0)).astype(np.float32)
    for name in data.categorical:
        counts = pc.value_counts(pc.drop_null(train.column(name))).to_pylist()
        vocab = [c["values"] for c in sorted(counts, key=lambda c: (-c["counts"], c["values"]))]
        idx = pc.index_in(table.column(name), value_set=pa.array(vocab))
        idx = pc.if_else(pc.is_null(table.column(name)), 0, pc.fill_null(pc.add(idx, 2), 1))
        columns[name] = idx.cast(pa.int32()).to_numpy(zero_copy_only=False)
    image = pc.cast(table.column("image"), pa.list_(pa.float32()))
    label = table.column("label").to_numpy(zero_copy_only=False).astype(np.int64)
    rng = np.random.default_rng(0)
    Path(out).mkdir(parents=True, exist_ok=True)
    for s, name in enumerate(["train", "val", "test"]):
        rows = np.flatnonzero(split == s)
        rows = rows[rng.permutation(len(rows))]
        (Path(out) / name).mkdir(exist_ok=True)
        for shard in range(num_shards):
            take = rows[shard::num_shards]
            part = pa.table({**{n: pa.array(c[take]) for n, c in columns.items()},
                             "image": image.take(pa.array(take)), "label": pa.array(label[take]),
                             "_row": pa.array(np.arange(len(take), dtype=np.int64))})
            pq.write_table(part, Path(out) / name / f"part-{shard:05d}.parquet", row_group_size=ROWS_PER_ROW_GROUP)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1_000_000])
    parser.add_argument("--num-shards", type=int, default=4)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--repeats", type=int, default=1, help="take the best of this many runs of each path")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="shard-bench-"))
    spark = spark_session(args.master)
    try:
        for rows in args.rows:
            raw = str(workdir / f"raw-{rows}")
            gen_start = time.perf_counter()
            data = generate_dataset(spark, raw, rows, seed=1, array_shape=[8], bad_rows=rows // 10_000,
                                    mode="overwrite")
            gen_s = time.perf_counter() - gen_start
            size = input_bytes(raw)
            spark_s = min(time_spark(spark, data, str(workdir / f"spark-{rows}"), args.num_shards)
                          for _ in range(args.repeats))
            arrow_s = min(time_pyarrow(data, str(workdir / f"arrow-{rows}-{i}"), args.num_shards)
                          for i in range(args.repeats))
            print(json.dumps({
                "rows": rows, "input_mb": round(size / 2 ** 20, 1), "master": args.master,
                "num_shards": args.num_shards, "generate_s": round(gen_s, 2),
                "spark_s": round(spark_s, 2), "spark_rows_per_s": round(rows / spark_s),
                "spark_mb_per_s": round(size / 2 ** 20 / spark_s, 2),
                "pyarrow_s": round(arrow_s, 2), "pyarrow_rows_per_s": round(rows / arrow_s),
                "pyarrow_mb_per_s": round(size / 2 ** 20 / arrow_s, 2),
                "ratio": round(arrow_s / spark_s, 3),
            }), flush=True)
            for path in workdir.glob(f"*-{rows}*"):
                shutil.rmtree(path, ignore_errors=True)
    finally:
        spark.stop()
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
