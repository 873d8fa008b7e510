"""Cheaper Spark driver JVM start-ups for the test suite.

The suite starts a few hundred driver JVMs (every CLI subprocess, docs command step, spark-submit, table
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
(no JDK 13+), the suite runs as before.

The JVM accepts an archive at another class path only where each jar is the same file (JDK 17 compares
the paths, then device and inode: a copy with the same size and mtime is refused, a hardlink is not).
.ci/bootstrap's venvs hardlink pyspark's jars from uv's cache, so every venv made from that cache, in any
clone, has the same jar files: for those, the archive is built once per machine under
``$SHARDTRAIN_CACHE/jvm-archives``, dumped with ``SPARK_HOME`` on a hardlinked copy of pyspark kept beside
it (so the paths it recorded outlive the venv it was made from), and keyed by the jars' inodes: a venv
whose jars are other files gets another archive. ``SHARDTRAIN_TEST_JVM_ARCHIVE=0``, or a ``SPARK_SUBMIT_OPTS``
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
    """Where the archive for this venv's pyspark and java lives: in the shared cache where the jars are
    hardlinks (other venvs may have the same files), else in the venv."""
    import pyspark

    java = shutil.which("java", path=os.path.join(os.environ["JAVA_HOME"], "bin")) if os.environ.get("JAVA_HOME") \
        else shutil.which("java")
    spark_home = os.path.dirname(os.path.realpath(pyspark.__file__))
    jars = os.path.join(spark_home, "jars")
    stats = sorted((name, os.stat(os.path.join(jars, name))) for name in os.listdir(jars) if name.endswith(".jar"))
    cache = os.environ.get("SHARDTRAIN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "shardtrain")
    shared = os.path.join(cache, "jvm-archives")
    if stats and all(st.st_nlink > 1 for _, st in stats):
        os.makedirs(shared, exist_ok=True)
        if os.stat(shared).st_dev == stats[0][1].st_dev:  # hardlinks cannot cross file systems
            key = "|".join([os.path.realpath(java or "java"), pyspark.__version__]
                           + [f"{name}:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}" for name, st in stats])
            return os.path.join(shared, f"spark-driver-{hashlib.sha256(key.encode()).hexdigest()[:16]}.jsa")
    key = "|".join([os.path.realpath(java or "java"), spark_home, pyspark.__version__])
    return os.path.join(sys.prefix, "share", "shardtrain-tests",
                        f"spark-driver-{hashlib.sha256(key.encode()).hexdigest()[:16]}.jsa")


def _linked_spark_home(path: str) -> str:
    """A copy of pyspark's package beside the shared archive at ``path``, every file a hardlink to this
    venv's: the class path the archive records, kept for as long as the archive is."""
    import pyspark

    home = f"{path[:-len('.jsa')]}.spark-home"
    if os.path.isdir(home):
        return home
    source = os.path.dirname(os.path.realpath(pyspark.__file__))
    partial = f"{home}.{os.getpid()}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(source, partial, copy_function=os.link, symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    os.replace(partial, home)
    return home


def _build(path: str) -> str | None:
    """Make the archive at ``path`` (atomically); the reason it could not be made, or None."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.{os.getpid()}.partial"
    scratch = f"{path}.{os.getpid()}.parquet"
    env = {**os.environ, "SPARK_SUBMIT_OPTS": f"-XX:ArchiveClassesAtExit={partial} -XX:TieredStopAtLevel=1",
           "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    if not path.startswith(os.path.join(sys.prefix, "")):
        try:
            env["SPARK_HOME"] = _linked_spark_home(path)
        except OSError as exc:  # e.g. the cache on another file system than the venv: no hardlinks
            return f"cannot link pyspark beside {path}: {exc}"
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
