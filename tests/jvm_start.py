"""Cheaper Spark driver JVM start-ups for the test suite.

The suite starts a few hundred driver JVMs (every CLI subprocess, README step, spark-submit, table
reader and Connect server), each on a handful of rows, so most of their CPU goes to loading and
JIT-compiling Spark's classes, not to the tests' work. On this 2-core machine the suite is CPU-bound,
so that time is the suite's wall time. Two JDK features cut it (a local[2] session's JVM: 18-20 CPU s
by default, 5 CPU s with both):

- a dynamic class-data-sharing archive (JDK 13+: ``-XX:ArchiveClassesAtExit`` once, then
  ``-XX:SharedArchiveFile``): Spark's classes mapped from one file instead of parsed and verified
  again in every JVM;
- ``-XX:TieredStopAtLevel=1``: the quick C1 compiler only, since no test JVM lives long enough for
  C2's optimised code to pay back its compile time.

Both go to ``SPARK_SUBMIT_OPTS``, which pyspark's launcher (spark-submit) puts on every driver's java
command line and which child processes inherit. They change how fast a JVM starts, never what it
computes, and only here: the product and benchmarks/ never set them. The archive is built once per
venv (it is only valid for the class path it was made from, so it lives in the venv that holds
pyspark's jars) under a lock, so xdist workers build it once between them. Where it cannot be built
(no JDK 13+), the suite runs as before. ``SHARDTRAIN_TEST_JVM_ARCHIVE=0``, or a ``SPARK_SUBMIT_OPTS``
of your own, leaves the JVMs alone.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time

# What the archive is made from: a session doing what the tests' drivers do (Parquet, SQL, Arrow to
# and from pandas), so their classes are in it. Classes outside it still load the usual way.
_WORKLOAD = """
import sys
from pyspark.sql import SparkSession
spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
spark.sparkContext.setLogLevel("ERROR")
df = spark.range(200).selectExpr("id", "cast(id % 3 as string) as c", "array(id * 0.5, 1.0) as v")
df.write.mode("overwrite").parquet(sys.argv[1])
back = spark.read.parquet(sys.argv[1]).groupBy("c").count().toPandas()
spark.createDataFrame(back).collect()
spark.stop()
"""


def _archive_path() -> str:
    import pyspark

    java = shutil.which("java", path=os.path.join(os.environ["JAVA_HOME"], "bin")) if os.environ.get("JAVA_HOME") \
        else shutil.which("java")
    key = "|".join([os.path.realpath(java or "java"), os.path.dirname(os.path.realpath(pyspark.__file__)),
                    pyspark.__version__])
    return os.path.join(sys.prefix, "share", "shardtrain-tests",
                        f"spark-driver-{hashlib.sha256(key.encode()).hexdigest()[:16]}.jsa")


def _build(path: str) -> str | None:
    """Make the archive at ``path`` (atomically); the reason it could not be made, or None."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.{os.getpid()}.partial"
    scratch = f"{path}.{os.getpid()}.parquet"
    env = {**os.environ, "SPARK_SUBMIT_OPTS": f"-XX:ArchiveClassesAtExit={partial} -XX:TieredStopAtLevel=1",
           "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    try:
        proc = subprocess.run([sys.executable, "-c", _WORKLOAD, scratch], env=env, capture_output=True, text=True,
                              timeout=600)
        if proc.returncode != 0 or not os.path.isfile(partial) or os.path.getsize(partial) == 0:
            return f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-300:].strip()}"
        os.replace(partial, path)
        return None
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if os.path.exists(partial):
            os.remove(partial)


def configure() -> str:
    """Set SPARK_SUBMIT_OPTS for this process and its children; one line saying what was done."""
    if os.environ.get("SHARDTRAIN_TEST_JVM_ARCHIVE") == "0":
        return "JVM start-up: left alone (SHARDTRAIN_TEST_JVM_ARCHIVE=0)"
    if os.environ.get("SPARK_SUBMIT_OPTS"):
        return "JVM start-up: left alone (SPARK_SUBMIT_OPTS is set)"
    try:
        path = _archive_path()
    except ImportError:
        return "JVM start-up: left alone (no pyspark)"
    built = ""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(f"{path}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder; the other workers wait, then use it
        if not os.path.isfile(path):
            start = time.monotonic()
            failed = _build(path)
            if failed:
                return f"JVM start-up: no class-data archive ({failed}); JVMs start the usual way"
            built = f", built in {time.monotonic() - start:.0f} s"
    os.environ["SPARK_SUBMIT_OPTS"] = f"-XX:SharedArchiveFile={path} -XX:TieredStopAtLevel=1"
    return f"JVM start-up: class-data archive {path}{built}; C1 compiler only"
