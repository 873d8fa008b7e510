"""What the test suite's JVM options (tests/jvm_start.py) save per Spark driver start-up, against
the default JVM, interleaved in one run: each round starts one small local[2] session (a Parquet
write and read, a pandas round trip: what a test's CLI subprocess does) in a fresh process per
variant, and reads the driver JVM's CPU seconds from /proc before it stops. CPU seconds are what a
CPU-bound suite on 2 cores pays; wall seconds swing with the machine's load.

    .venv/bin/python benchmarks/jvm_start.py --rounds 3

Prints one JSON line per start-up and, at the end, each variant's median as a ratio to the default.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

CHILD = """
import os, sys, time
start = time.monotonic()
from pyspark.sql import SparkSession
spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
spark.sparkContext.setLogLevel("ERROR")
df = spark.range(1000).selectExpr("id", "cast(id % 7 as string) as c")
df.write.mode("overwrite").parquet(sys.argv[1])
spark.createDataFrame(spark.read.parquet(sys.argv[1]).groupBy("c").count().toPandas()).collect()
pid = spark.sparkContext._gateway.proc.pid
fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
print("RESULT", cpu, time.monotonic() - start)
spark.stop()
"""


def start_up(opts: str | None, scratch: str) -> tuple[float, float]:
    env = {k: v for k, v in os.environ.items() if k != "SPARK_SUBMIT_OPTS"}
    if opts:
        env["SPARK_SUBMIT_OPTS"] = opts
    out = subprocess.run([sys.executable, "-c", CHILD, scratch], env=env, capture_output=True, text=True, timeout=900)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT")]
    assert out.returncode == 0 and line, out.stderr[-2000:]
    cpu, wall = map(float, line[0].split()[1:])
    return cpu, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import jvm_start

    os.environ.pop("SPARK_SUBMIT_OPTS", None)
    print(json.dumps({"setup": jvm_start.configure()}), flush=True)
    suite = os.environ.pop("SPARK_SUBMIT_OPTS", "")
    archive = suite.split()[0] if suite.startswith("-XX:SharedArchiveFile=") else None
    variants = {"default": None, "c1": "-XX:TieredStopAtLevel=1"}
    if archive:
        variants["archive"] = archive
        variants["archive+c1 (the suite)"] = suite
    cpu = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for name, opts in variants.items():
                c, w = start_up(opts, os.path.join(tmp, f"{rnd}-{len(cpu[name])}"))
                cpu[name].append(c)
                print(json.dumps({"round": rnd, "variant": name, "jvm_cpu_s": round(c, 2), "wall_s": round(w, 2),
                                  "load": os.getloadavg()[0]}), flush=True)
    base = statistics.median(cpu["default"])
    for name, values in cpu.items():
        print(json.dumps({"variant": name, "median_jvm_cpu_s": round(statistics.median(values), 2),
                          "vs_default": round(statistics.median(values) / base, 3)}), flush=True)


if __name__ == "__main__":
    main()
