"""The one SparkSession factory (jobs, notebooks, tests, benchmarks and ``doctor`` all use it), and
turning Spark's Java errors into readable ones.

It also owns how much Spark says on the console. A session it creates is quiet: the driver JVM
gets log4j2-quiet.properties (warnings and errors only, on stderr; no start-up banner) and no
console progress bars, so a command's output is shardtrain's own lines. ``set_spark_verbose(True)``
(the command's -v/--verbose) leaves Spark's own logging as Spark configures it.

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

QUIET_LOG4J = os.path.join(os.path.dirname(os.path.abspath(__file__)), "log4j2-quiet.properties")
_DRIVER_JAVA_OPTIONS = "spark.driver.extraJavaOptions"
# Process-wide, like the logging configuration it mirrors: set once by the command line.
_spark_verbose = False


def set_spark_verbose(verbose: bool) -> None:
    """Verbose: sessions created from now on keep Spark's own logging (INFO and its banner)."""
    global _spark_verbose
    _spark_verbose = bool(verbose)


def get_or_create_session(cfg: SparkConfig | None = None, log_level: str | None = None):
    """Return the active SparkSession (a notebook's, spark-submit's) or build one from ``cfg``.

    ``cfg.conf`` applies only to a session this call creates: an existing session's static
    settings cannot change, and silently half-applying them would be worse. ``log_level``: the
    JVM's level once the session runs (default WARN, or INFO when verbose).
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
    conf = {**defaults, **cfg.conf}
    if not _spark_verbose and not _operator_log4j_config():
        conf = _quiet_driver_logging(conf)
    for key, value in conf.items():
        builder = builder.config(key, str(value).lower() if isinstance(value, bool) else str(value))
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel(log_level or ("INFO" if _spark_verbose else "WARN"))
    return session


def _quiet_driver_logging(conf: dict) -> dict:
    """Give the driver JVM our log4j2 configuration before it logs anything.

    Launched from Python (the shardtrain command, tests, benchmarks), the JVM does not exist yet:
    pyspark's launcher passes spark.driver.extraJavaOptions to the java command line. Under
    spark-submit the JVM already runs, and has only logged its own start-up; we reconfigure its
    log4j2 context before the SparkContext starts logging.
    """
    if os.environ.get("PYSPARK_GATEWAY_PORT"):
        _reconfigure_running_jvm()
        return conf
    options = str(conf.get(_DRIVER_JAVA_OPTIONS, ""))
    if "log4j2.configurationFile" in options:
        return conf  # the config names its own
    location = f"file:{QUIET_LOG4J}"
    flag = f'"-Dlog4j2.configurationFile={location}"' if " " in location else f"-Dlog4j2.configurationFile={location}"
    return {**conf, _DRIVER_JAVA_OPTIONS: f"{options} {flag}".strip()}


def _reconfigure_running_jvm() -> None:
    from pyspark import SparkContext

    SparkContext._ensure_initialized()
    jvm = SparkContext._jvm
    if jvm.java.lang.System.getProperty("log4j2.configurationFile"):
        return  # spark-submit --driver-java-options named one
    context = jvm.org.apache.logging.log4j.LogManager.getContext(False)
    context.setConfigLocation(jvm.java.io.File(QUIET_LOG4J).toURI())


def _operator_log4j_config() -> bool:
    """A log4j2.properties in Spark's conf directory is the operator's choice: we leave it alone."""
    conf_dir = os.environ.get("SPARK_CONF_DIR") or (
        os.path.join(os.environ["SPARK_HOME"], "conf") if os.environ.get("SPARK_HOME") else None)
    return bool(conf_dir) and os.path.isfile(os.path.join(conf_dir, "log4j2.properties"))


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


def ddl_schema(spark, ddl: str):
    """A Spark DDL string ("a INT, b STRING") as a StructType (``fromDDL`` where pyspark has it)."""
    from pyspark.sql.types import StructType

    return StructType.fromDDL(ddl) if hasattr(StructType, "fromDDL") else spark.createDataFrame([], ddl).schema
