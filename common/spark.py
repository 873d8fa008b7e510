"""The one SparkSession factory (jobs, notebooks, tests, benchmarks and ``doctor`` all use it), and
turning Spark's Java errors into readable ones.

Driver-only: executors never import this module.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from typing import Iterator

from common.config import SparkConfig
from common.errors import ShardtrainError, SparkJobError


def get_or_create_session(cfg: SparkConfig | None = None, log_level: str = "WARN"):
    """Return the active SparkSession (a notebook's, spark-submit's) or build one from ``cfg``.

    ``cfg.conf`` applies only to a session this call creates: an existing session's static
    settings cannot change, and silently half-applying them would be worse.
    """
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    cfg = cfg or SparkConfig()
    # Executors must run the same interpreter as the driver (same torch, pyarrow, horovod).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if cfg.master.startswith("local"):
        # Everything stays on this machine: bind to loopback, not whatever eth0 resolves to.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = SparkSession.builder.appName(cfg.app_name)
    if not _submitted_with_master():
        builder = builder.master(cfg.master)
    defaults = {
        "spark.sql.session.timeZone": "UTC",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
    }
    for key, value in {**defaults, **cfg.conf}.items():
        builder = builder.config(key, str(value).lower() if isinstance(value, bool) else str(value))
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel(log_level)
    return session


def _submitted_with_master() -> bool:
    # Under spark-submit --master X the launcher has set spark.master; it must win over the config.
    if not os.environ.get("PYSPARK_GATEWAY_PORT"):
        return False
    from pyspark import SparkConf, SparkContext

    # Before the gateway is connected SparkConf() is an empty Python dict and never sees the
    # launcher's settings (spark-submit --master was silently replaced by cfg.master). Connect
    # first, so SparkConf reads the JVM's system properties.
    SparkContext._ensure_initialized()
    return SparkConf().contains("spark.master")


_PY_ERR = re.compile(r"(Traceback \(most recent call last\):.*?)(?:\n\tat |\n\n|$)", re.S)


def explain_java_error(exc: BaseException) -> str:
    """Pull the Python traceback (or the root Java cause) out of a Py4JJavaError's text."""
    text = str(exc)
    match = _PY_ERR.search(text)
    if match:
        return match.group(1).strip()
    causes = re.findall(r"Caused by: ([^\n]+)", text)
    if causes:
        return causes[-1]
    return text.splitlines()[0] if text else type(exc).__name__


@contextlib.contextmanager
def spark_errors(what: str) -> Iterator[None]:
    """Re-raise a bare Py4JJavaError / PythonException as SparkJobError naming ``what``."""
    try:
        yield
    except ShardtrainError:
        raise
    except Exception as exc:  # noqa: BLE001 - we re-raise with context, never swallow
        name = type(exc).__name__
        if name in ("Py4JJavaError", "PythonException", "AnalysisException", "SparkException"):
            raise SparkJobError(f"{what} failed: {explain_java_error(exc)}") from exc
        raise


def to_spark_path(uri: str) -> str:
    """A storage URI as Spark's Hadoop file systems spell it: file:///abs for local paths, s3a:// for S3."""
    from common.storage import resolve

    loc = resolve(uri)
    if loc.scheme == "file":
        return "file://" + loc.path
    if loc.scheme == "s3":
        return "s3a://" + loc.path
    return loc.uri
