"""The shard job's fixed cost on small inputs, against the plain Spark write, in one warm session.

    .venv/bin/python benchmarks/shard_small.py --workdir /tmp/shard-small
    .venv/bin/python benchmarks/shard_small.py --workdir /tmp/shard-small --rows 1000 20000 --repeats 7
    .venv/bin/python benchmarks/shard_small.py --workdir /tmp/shard-small --reference main

For each size (default 1,000 and 20,000 rows), the demo's input (pipelines.generate with the
columns of conf/shard.yaml: 4 numeric, 2 categorical, an 8-float array, a binary label; one bad
row per 1,000) is generated once under ``--workdir`` and reused by later runs with the same
workdir. One local[2] session is started and warmed (one run of each path, not timed); then,
alternating, ``--repeats`` times each:
  - ``plain``: ``spark.read.parquet(raw).repartition(n).write.parquet(out)``, n = splits x shards;
  - ``job``: ``run_shard_job`` with conf/shard.yaml's settings and ``output.mode=overwrite`` into
    a fresh path each time.
One JSON line per size: median and every time of each path, ``ratio`` = median job seconds /
median plain seconds (the goal is <= 3), the Spark jobs, stages and tasks each shard job
launched (counted with a job group through ``SparkContext.statusTracker``), and the sha256 of
every output file of one run into a fixed path (``digests``).

What legitimately differs between two runs over the same input and config: ``created_at`` in
``_manifest.json`` and ``committed_at`` in ``_COMMITTED`` (wall-clock times, the only ones: shard
and quarantine files are written by pyarrow without timestamps, and staging tokens never reach
the output). Those two values are blanked before hashing; every other byte counts. The config
(``config.yaml``, the manifest's ``config`` and input fingerprint) holds ``output.path``, and the
manifest holds the source files' mtimes, so digests compare runs into the same path over the same
generated files: ``--reference REV`` extracts commit REV (``git archive``, the repository is not
touched), runs this same digest run with that code in a subprocess over the same inputs and path,
and reports whether every file is byte-identical (``identical``) and which differ. Within the
timed runs, the data files (shards and quarantine, whose bytes do not depend on the path) are
compared across repetitions too (``repeats_identical``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _code_root() -> Path:
    """The tree whose code runs: ``--code-root`` (a reference commit's), else this file's."""
    if "--code-root" in sys.argv:
        return Path(sys.argv[sys.argv.index("--code-root") + 1]).resolve()
    return Path(__file__).resolve().parents[1]


sys.path.insert(0, str(_code_root()))

SPLITS = 3
NUM_SHARDS = 4
# Values that are wall-clock times by design (see the module docstring); blanked before hashing.
TIMESTAMP_FIELDS = {"_manifest.json": re.compile(rb'"created_at": "[^"]*"'),
                    "_COMMITTED": re.compile(rb'"committed_at": "[^"]*"')}


def spark_session():
    from common.config import SparkConfig
    from common.spark import get_or_create_session

    conf = {"spark.sql.shuffle.partitions": 8, "spark.ui.enabled": False, "spark.driver.memory": "2g"}
    return get_or_create_session(SparkConfig(master="local[2]", app_name="shard-small", conf=conf), log_level="ERROR")


def dataset(spark, workdir: Path, rows: int):
    """The generated input, written once per size and described by a JSON file beside it."""
    from pipelines.generate import GeneratedDataset, generate_dataset

    raw, info = workdir / f"raw-{rows}", workdir / f"raw-{rows}.json"
    if info.exists() and raw.exists():
        return GeneratedDataset(**json.loads(info.read_text()))
    data = generate_dataset(spark, str(raw), rows, seed=1, format="parquet", array_shape=[8], bad_rows=rows // 1000,
                            mode="overwrite")
    info.write_text(json.dumps(dataclasses.asdict(data)))
    return data


def shard_config(data, out: str):
    """conf/shard.yaml's features, split and output settings over the generated data."""
    from common.config import from_dict
    from pipelines.shard_config import ShardConfig

    return from_dict(ShardConfig, data.shard_config(
        out, features={"max_vocab": 1000, "min_count": 5}, output={"num_shards": NUM_SHARDS, "mode": "overwrite"},
        quality={"max_bad_fraction": 0.01}))


def file_digests(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (relative path -> hex), timestamps blanked."""
    digests = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        data = path.read_bytes()
        if rel in TIMESTAMP_FIELDS:
            data = TIMESTAMP_FIELDS[rel].sub(b'"<time>": ""', data)
        digests[rel] = hashlib.sha256(data).hexdigest()
    return digests


class JobCounter:
    """The Spark jobs, stages and tasks launched by what runs inside ``with counter.group(name)``."""

    def __init__(self, spark):
        self.sc = spark.sparkContext
        self.tracker = self.sc.statusTracker()
        self.n = 0

    def run(self, fn):
        self.n += 1
        group = f"shard-small-{os.getpid()}-{self.n}"
        self.sc.setJobGroup(group, group)
        try:
            result = fn()
        finally:
            self.sc.setLocalProperty("spark.jobGroup.id", None)
            self.sc.setLocalProperty("spark.job.description", None)
        jobs = sorted(self.tracker.getJobIdsForGroup(group))
        stages, tasks = set(), 0
        for job in jobs:
            info = self.tracker.getJobInfo(job)
            for stage in (info.stageIds if info else []):
                stage_info = self.tracker.getStageInfo(stage)
                if stage_info is not None and stage_info.numCompletedTasks > 0 and stage not in stages:
                    stages.add(stage)
                    tasks += stage_info.numCompletedTasks
        return result, {"jobs": len(jobs), "stages_run": len(stages), "tasks": tasks}


def time_plain(spark, data, out: str) -> float:
    start = time.perf_counter()
    spark.read.parquet(data.path).repartition(SPLITS * NUM_SHARDS).write.mode("overwrite").parquet(out)
    return time.perf_counter() - start


def time_job(spark, counter: JobCounter, data, out: str) -> tuple[float, dict]:
    from pipelines.shard_job import run_shard_job

    cfg = shard_config(data, out)
    start = time.perf_counter()
    result, launched = counter.run(lambda: run_shard_job(spark, cfg))
    elapsed = time.perf_counter() - start
    assert result.manifest.data["accounting"]["input_rows"] == data.rows
    return elapsed, launched


def digest_run(spark, data, workdir: Path) -> dict[str, str]:
    """One job into the size's fixed path (removed first): the digests a reference run compares."""
    from pipelines.shard_job import run_shard_job

    out = workdir / f"identity-{data.rows}"
    shutil.rmtree(out, ignore_errors=True)
    run_shard_job(spark, shard_config(data, str(out)))
    digests = file_digests(out)
    shutil.rmtree(out, ignore_errors=True)
    return digests


def data_files(digests: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in digests.items() if k.endswith(".parquet")}


def measure(spark, counter: JobCounter, data, workdir: Path, repeats: int) -> dict:
    time_plain(spark, data, str(workdir / "warm-plain"))  # warm: first-use planning and class loading
    time_job(spark, counter, data, str(workdir / "warm-job"))
    plain, job, launched, files = [], [], [], []
    for i in range(repeats):  # alternate, so load changes hit both paths alike
        plain_out, job_out = workdir / f"plain-{data.rows}-{i}", workdir / f"job-{data.rows}-{i}"
        plain.append(time_plain(spark, data, str(plain_out)))
        seconds, counts = time_job(spark, counter, data, str(job_out))
        job.append(seconds)
        launched.append(counts)
        files.append(data_files(file_digests(job_out)))
    for path in workdir.glob("warm-*"):
        shutil.rmtree(path, ignore_errors=True)
    for path in [*workdir.glob(f"plain-{data.rows}-*"), *workdir.glob(f"job-{data.rows}-*")]:
        shutil.rmtree(path, ignore_errors=True)
    return {
        "rows": data.rows, "num_shards": NUM_SHARDS, "repeats": repeats,
        "plain_median_s": round(statistics.median(plain), 3), "job_median_s": round(statistics.median(job), 3),
        "ratio": round(statistics.median(job) / statistics.median(plain), 2),
        "plain_runs_s": [round(s, 3) for s in plain], "job_runs_s": [round(s, 3) for s in job],
        "spark_per_job": launched[0], "spark_per_job_same_every_run": all(c == launched[0] for c in launched),
        "repeats_identical": all(f == files[0] for f in files),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def reference_digests(rev: str, workdir: Path, rows: list[int]) -> dict[str, dict[str, str]]:
    """The digest runs with commit ``rev``'s code, in a subprocess (its own session)."""
    repo = Path(__file__).resolve().parents[1]
    tree = Path(tempfile.mkdtemp(prefix="shard-small-ref-"))
    try:
        archive = subprocess.run(["git", "-C", str(repo), "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        env = {**os.environ, "PYTHONPATH": str(tree)}
        done = subprocess.run([sys.executable, __file__, "--code-root", str(tree), "--digests-only",
                               "--workdir", str(workdir), "--rows", *map(str, rows)],
                              capture_output=True, text=True, env=env, cwd=tree)  # Python workers import from cwd
        if done.returncode != 0:
            raise RuntimeError(f"the reference run of {rev} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(tree, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1_000, 20_000])
    parser.add_argument("--repeats", type=int, default=5, help="alternating runs of each path; medians are reported")
    parser.add_argument("--workdir", required=True, help="the generated inputs live here and are reused")
    parser.add_argument("--reference", default=None, help="a git revision whose output bytes this code must match")
    parser.add_argument("--code-root", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--digests-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    spark = spark_session()
    try:
        inputs = {rows: dataset(spark, workdir, rows) for rows in args.rows}
        if args.digests_only:
            print(json.dumps({str(rows): digest_run(spark, data, workdir) for rows, data in inputs.items()}))
            return 0
        counter = JobCounter(spark)
        ours = {}
        for rows, data in inputs.items():
            result = measure(spark, counter, data, workdir, args.repeats)
            ours[str(rows)] = digest_run(spark, data, workdir)
            result["digests"] = ours[str(rows)]
            print(json.dumps(result), flush=True)
    finally:
        spark.stop()
    if args.reference:
        theirs = reference_digests(args.reference, workdir, args.rows)
        for rows in map(str, args.rows):
            differ = sorted(k for k in set(ours[rows]) | set(theirs[rows]) if ours[rows].get(k) != theirs[rows].get(k))
            print(json.dumps({"rows": int(rows), "reference": args.reference, "files": len(ours[rows]),
                              "identical": not differ, "differing_files": differ}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
