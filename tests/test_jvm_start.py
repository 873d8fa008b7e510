"""The suite's cheaper JVM start-ups (tests/jvm_start.py) are really in effect: the session's own
driver JVM, started by pyspark's launcher, maps the class-data archive and runs C1 only, and a
driver JVM started by a child process (what every CLI test runs) inherits the same."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.stack]

CHILD = """
from pyspark.sql import SparkSession
spark = SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false").getOrCreate()
pid = spark.sparkContext._gateway.proc.pid
print("MAPS", open(f"/proc/{pid}/maps").read().count(".jsa"))
print("CMDLINE", open(f"/proc/{pid}/cmdline").read().replace(chr(0), " "))
spark.stop()
"""


def _archive() -> str:
    opts = os.environ.get("SPARK_SUBMIT_OPTS", "")
    if "-XX:SharedArchiveFile=" not in opts:
        pytest.skip(f"the suite's JVM start-ups are left alone here (SPARK_SUBMIT_OPTS={opts!r})")
    return opts.split("-XX:SharedArchiveFile=", 1)[1].split()[0]


def test_the_session_driver_jvm_maps_the_archive_and_runs_c1_only(spark):
    archive = _archive()
    pid = spark.sparkContext._gateway.proc.pid
    with open(f"/proc/{pid}/maps") as fh:
        assert archive in fh.read()  # mapped: the JVM uses it (a class-path mismatch maps nothing)
    with open(f"/proc/{pid}/cmdline") as fh:
        assert "-XX:TieredStopAtLevel=1" in fh.read().split("\0")


@pytest.mark.process
def test_a_child_process_driver_jvm_inherits_it():
    _archive()
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYSPARK_PYTHON": sys.executable})
    assert out.returncode == 0, out.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if line.startswith(("MAPS", "CMDLINE")))
    assert int(lines["MAPS"]) > 0 and "-XX:TieredStopAtLevel=1" in lines["CMDLINE"]
