"""Shard job throughput vs the plain Spark write a user would run instead, in the same session.

    .venv/bin/python benchmarks/shard_throughput.py --rows 2000000 10000000 --workdir /tmp/shard-bench
    .venv/bin/python benchmarks/shard_throughput.py --rows 2000000 --formats parquet --repeats 3
    .venv/bin/python benchmarks/shard_throughput.py --rows 2000000 --cluster-workers 2 --workdir /tmp/shard-bench

For each size and input format, the dataset (4 numeric, 2 categorical, an 8-float array for
Parquet, a binary label, 0.01% bad rows) is generated once under ``--workdir`` and reused by
later runs with the same workdir. Then, alternating, ``--repeats`` times each:
  - ``plain``: ``spark.read.parquet(raw).repartition(n).write.parquet(out)`` (for CSV:
    ``spark.read.csv(raw, header, schema).repartition(n).write.parquet(out)``), n = splits x shards;
  - ``job``: run_shard_job on the same files (quarantine, split, exact train statistics,
    vocabularies, balanced seeded-shuffle shards, sha256, manifest, atomic publish).
One JSON line per size and format: the best and every time of each path, ``ratio`` = best plain
seconds / best job seconds (>= 0.5 means the job costs at most 2x the plain write), the job's
phase seconds (from the ``shardtrain.shard`` phase log of its best run) and ns per input row.

``--cluster-workers N`` runs both paths on a Spark standalone cluster it starts on 127.0.0.1
(a master and N one-core workers, tests/spark_cluster.py) and stops by pid at the end, so the
ratio with executors (shuffles over the network stack, Python workers in other JVMs) is visible.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # spark_cluster.py

from common.config import from_dict  # noqa: E402
from pipelines.generate import GeneratedDataset, generate_dataset  # noqa: E402
from pipelines.shard_config import ShardConfig  # noqa: E402
from pipelines.shard_job import run_shard_job  # noqa: E402
from spark_cluster import start_cluster  # noqa: E402

ROWS_PER_ROW_GROUP = 50_000
SPLITS = 3
PHASE_LINE = re.compile(r"^(?P<phase>[^:]+): [\d,]+ rows in (?P<seconds>[\d.]+)s")


def spark_session(master: str, driver_memory: str, executor_memory: str):
    from common.config import SparkConfig
    from common.spark import get_or_create_session

    conf = {"spark.sql.shuffle.partitions": 8, "spark.ui.enabled": False, "spark.driver.memory": driver_memory,
            "spark.executor.memory": executor_memory}
    return get_or_create_session(SparkConfig(master=master, app_name="shard-throughput", conf=conf), log_level="ERROR")


def input_bytes(path: str) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file() and not p.name.startswith(("_", ".")))


def dataset(spark, workdir: Path, rows: int, fmt: str) -> GeneratedDataset:
    """The generated input, written once per (rows, format) and described by a JSON file beside it."""
    raw = workdir / f"raw-{fmt}-{rows}"
    info = workdir / f"raw-{fmt}-{rows}.json"
    if info.exists() and raw.exists():
        return GeneratedDataset(**json.loads(info.read_text()))
    data = generate_dataset(spark, str(raw), rows, seed=1, format=fmt, array_shape=[8] if fmt != "csv" else None,
                            bad_rows=rows // 10_000, mode="overwrite")
    info.write_text(json.dumps(dataclasses.asdict(data)))
    return data


def time_plain(spark, data: GeneratedDataset, out: str, partitions: int) -> float:
    start = time.perf_counter()
    if data.format == "csv":
        frame = spark.read.option("header", "true").schema(data.schema_ddl).csv(data.path)
    else:
        frame = spark.read.parquet(data.path)
    frame.repartition(partitions).write.mode("overwrite").parquet(out)
    return time.perf_counter() - start


class _PhaseLog(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.phases: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        match = PHASE_LINE.match(record.getMessage())
        if match:
            self.phases[match["phase"]] = float(match["seconds"])


def time_job(spark, data: GeneratedDataset, out: str, num_shards: int) -> tuple[float, dict[str, float]]:
    cfg = from_dict(ShardConfig, data.shard_config(out, output={"num_shards": num_shards, "mode": "overwrite",
                                                                "rows_per_row_group": ROWS_PER_ROW_GROUP},
                                                   quality={"max_bad_fraction": 0.01}))
    phases = _PhaseLog()
    logger = logging.getLogger("shardtrain.shard")
    logger.addHandler(phases)
    logger.setLevel(logging.INFO)
    try:
        start = time.perf_counter()
        result = run_shard_job(spark, cfg)
        elapsed = time.perf_counter() - start
    finally:
        logger.removeHandler(phases)
    assert result.manifest.data["accounting"]["input_rows"] == data.rows
    return elapsed, phases.phases


def measure(spark, data: GeneratedDataset, workdir: Path, num_shards: int, repeats: int, master: str) -> dict:
    plain, job = [], []
    for i in range(repeats):  # alternate, so load changes hit both paths alike
        plain.append(time_plain(spark, data, str(workdir / f"plain-{i}"), SPLITS * num_shards))
        job.append(time_job(spark, data, str(workdir / f"job-{i}"), num_shards))
        for path in (workdir / f"plain-{i}", workdir / f"job-{i}"):
            shutil.rmtree(path, ignore_errors=True)
    best_job, phases = min(job, key=lambda r: r[0])
    return {
        "rows": data.rows, "format": data.format, "input_mb": round(input_bytes(data.path) / 2 ** 20, 1),
        "master": master, "num_shards": num_shards,
        "plain_s": round(min(plain), 2), "job_s": round(best_job, 2),
        "ratio": round(min(plain) / best_job, 3),
        "plain_runs_s": [round(s, 2) for s in plain], "job_runs_s": [round(s, 2) for s, _ in job],
        "job_ns_per_row": round(best_job / data.rows * 1e9), "plain_ns_per_row": round(min(plain) / data.rows * 1e9),
        "job_phases_s": phases,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[2_000_000])
    parser.add_argument("--formats", nargs="+", default=["parquet", "csv"], choices=["parquet", "csv"])
    parser.add_argument("--num-shards", type=int, default=4)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--driver-memory", default="4g")
    parser.add_argument("--cluster-workers", type=int, default=0,
                        help="start a standalone cluster with this many 1-core workers and run on it (overrides --master)")
    parser.add_argument("--executor-memory", default="2g", help="per executor, with --cluster-workers")
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs of each path; the best is reported")
    parser.add_argument("--workdir", default=None, help="keep the generated inputs here and reuse them")
    args = parser.parse_args()
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="shard-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    cluster = start_cluster(num_workers=args.cluster_workers, cores=1, memory="3g") if args.cluster_workers else None
    master = cluster.master_url if cluster else args.master
    if cluster is not None:
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")  # the driver on loopback, like the cluster
    try:
        spark = spark_session(master, args.driver_memory, args.executor_memory)
        try:
            for rows in args.rows:
                for fmt in args.formats:
                    data = dataset(spark, workdir, rows, fmt)
                    result = measure(spark, data, workdir, args.num_shards, args.repeats, master)
                    result["cluster_workers"] = args.cluster_workers
                    print(json.dumps(result), flush=True)
        finally:
            spark.stop()
    finally:
        if cluster is not None:
            cluster.stop()
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
