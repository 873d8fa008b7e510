"""The one SparkSession factory (jobs, notebooks, tests, benchmarks and ``doctor`` all use it), and
turning Spark's Java errors into readable ones.

It is also the one place that tells classic Spark from Spark Connect (``is_connect``; Databricks
standard and serverless compute, ``spark.remote``/``SPARK_REMOTE``) and a Connect server on this
machine from one on another (``remote_connect_host``: there this machine's paths name nothing), and
the only module that touches ``sparkContext`` or the JVM: the functions below it (``spark_setting``,
``default_parallelism``, ``LaunchJobs``, ``driver_address``) answer the same question on both, and
their classic branches are the only code that runs there (tests/test_connect_guard.py checks that no
other module does).

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
import threading
import warnings
from typing import Iterator

from common.config import SparkConfig
from common.errors import ConfigError, InputDataError, ShardtrainError, SparkJobError

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
    JVM's level once the session runs (default WARN, or INFO when verbose); a Spark Connect
    server's logging is the server's own, so it is left alone there.

    Spark Connect: ``spark.remote`` in ``cfg.conf`` (``sc://host:port``, or ``local[N]`` for a
    Connect server in this process) or the ``SPARK_REMOTE`` environment variable; then
    ``cfg.master`` is not used (pyspark refuses a master beside a remote).
    """
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    cfg = cfg or SparkConfig()
    user_conf = dict(cfg.conf)
    remote = _connect_url(user_conf.pop("spark.remote", None))
    # Executors must run the same interpreter as the driver (same torch, pyarrow, horovod).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    local = remote.startswith("local") if remote else cfg.master.startswith("local")
    if local:
        # Everything stays on this machine: bind to loopback, not whatever eth0 resolves to.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = SparkSession.builder.appName(cfg.app_name)
    if remote:
        if "SPARK_REMOTE" not in os.environ:
            builder = builder.remote(remote)  # SPARK_REMOTE is read by pyspark itself
    elif not _submitted_with_master():
        builder = builder.master(cfg.master)
    defaults = {
        "spark.sql.session.timeZone": "UTC",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
    }
    conf = {**defaults, **user_conf}
    # A remote sc:// server started long ago: only its runtime SQL settings can still be set.
    if not _spark_verbose and not _operator_log4j_config() and (remote is None or local):
        conf = _quiet_driver_logging(conf)
    for key, value in conf.items():
        builder = builder.config(key, str(value).lower() if isinstance(value, bool) else str(value))
    with warnings.catch_warnings():
        if remote and local:
            # pyspark starts the local Connect server with every setting, then tries them all again on
            # the client session and warns about each static one it cannot set twice.
            warnings.filterwarnings("ignore", message=r"Failed to set spark\.", category=UserWarning)
        session = builder.getOrCreate()
    if not is_connect(session):
        session.sparkContext.setLogLevel(log_level or ("INFO" if _spark_verbose else "WARN"))
    return session


def _connect_url(configured: str | None) -> str | None:
    """The Spark Connect URL: ``spark.remote`` from the config, else ``SPARK_REMOTE``; both set and
    different is refused (pyspark would only say that the two disagree)."""
    env = os.environ.get("SPARK_REMOTE")
    if configured and env and str(configured) != env:
        raise ConfigError(f"spark.conf spark.remote={configured} and the environment's SPARK_REMOTE={env} name "
                          "different Spark Connect servers: keep one of them")
    return str(configured) if configured else env


def is_connect(spark) -> bool:
    """True for a Spark Connect session (no SparkContext, RDDs or JVM in this process's reach)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def remote_connect_host(spark=None, cfg: SparkConfig | None = None) -> str | None:
    """The host of the Spark Connect server a job's Spark runs on, where that server is another
    machine; None on classic Spark and on a Connect server on this machine.

    The session asked: ``spark``, else the active one (a notebook's), else the one
    ``get_or_create_session(cfg)`` would connect to (``spark.remote`` or ``SPARK_REMOTE``), which is
    read, not connected to. On this machine: ``local[N]`` (pyspark starts that server in this
    process) and a loopback host (``sc://localhost``, 127.0.0.1, ::1); such a server shares this
    machine's files. Any other host is taken as another machine, even this one under another name
    (connect to sc://localhost then)."""
    if spark is None and "pyspark.sql" in sys.modules:  # a session can be active only once pyspark is imported
        from pyspark.sql import SparkSession

        spark = SparkSession.getActiveSession()
    if spark is not None:
        return _remote(spark.client.host) if is_connect(spark) else None
    url = _connect_url((cfg or SparkConfig()).conf.get("spark.remote"))
    if not url or url.startswith("local"):
        return None
    from urllib.parse import urlparse

    return _remote(urlparse(url).hostname or "localhost")  # sc:// with no host: pyspark's localhost


def _remote(host: str) -> str | None:
    """``host``, unless it is this machine's loopback (a name or an address)."""
    import ipaddress

    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return None
    try:
        return None if ipaddress.ip_address(host.strip("[]")).is_loopback else host
    except ValueError:
        return host


def check_paths_reach_cluster(cfg, spark=None) -> None:
    """A job whose Spark runs on a Spark Connect server on another machine (``remote_connect_host``)
    reads and writes through that cluster, where this machine's local paths name nothing (or
    something else): refuse one (exit 2) naming its key, before any work. ``cfg``: a job's config
    (its ``spark`` section says where a session it creates connects); ``spark``: the job's session,
    where it has one already."""
    host = remote_connect_host(spark, cfg.spark)
    if host is None:
        return
    from common.config import storage_paths
    from common.storage import is_local_path

    for key, uri in storage_paths(cfg).items():
        if is_local_path(uri):
            raise ConfigError(f"{key} is {uri}, a path on this machine, but this job's Spark runs on the Spark Connect "
                              f"server at {host}, whose executors cannot read this machine's files: give a URI the "
                              "cluster can read (s3://, hdfs://, dbfs:/ or a /Volumes/... path)")


def spark_setting(spark, key: str, default: str | None = None) -> str | None:
    """A Spark setting (static or runtime) as the application runs with it."""
    if is_connect(spark):
        return spark.conf.get(key, default)
    # Classic: the SparkContext's own conf, which also holds what the launcher (spark-submit) set.
    return spark.sparkContext.getConf().get(key, default)


def default_parallelism(spark) -> int:
    """The cluster's default parallelism (its cores, or spark.default.parallelism)."""
    if not is_connect(spark):
        return spark.sparkContext.defaultParallelism
    # Connect offers no SparkContext: a range without a partition count gets exactly this many
    # partitions (spark.sql.leafNodeDefaultParallelism, else the scheduler's default parallelism),
    # so one tiny job that counts them asks the cluster itself.
    from pyspark.sql import functions as F

    row = spark.range(0, 1 << 16).select(F.spark_partition_id().alias("p")).agg(F.max("p")).first()
    return int(row[0]) + 1


def driver_address(spark) -> str:
    """The host the Spark tasks can reach this Python process at (for the ranks' progress reports).
    ``SHARDTRAIN_PROGRESS_HOST`` overrides it. Classic: the driver's host. Connect: the client runs
    apart from the cluster's driver; with a local Connect server (``remote("local[N]")``) it is the
    same machine, else this host's name, which the cluster may well not reach (the launch then
    supervises by Spark's task state, training.launchers.supervisor)."""
    import socket

    override = os.environ.get("SHARDTRAIN_PROGRESS_HOST")
    if override:
        return override
    if spark is None:
        return "127.0.0.1"
    if not is_connect(spark) or os.environ.get("SPARK_LOCAL_REMOTE"):
        return spark_setting(spark, "spark.driver.host") or socket.gethostname()
    return socket.getfqdn()


class LaunchJobs:
    """The Spark jobs one launch starts (its barrier job), to watch and cancel; no other launch's.

    Created on the thread that runs the launch, and closed there. Parallel sweep trials are launches
    on threads of one driver, so "every job that was not running before" would also name the other
    trials' barrier jobs: each launch's jobs carry a job tag of its own instead.

    Connect: ``addTag`` on this thread, ``interruptTag`` from any, and the execution progress the
    server streams. Classic (``SparkContext.addJobTag``/``cancelJobsWithTag``, pyspark >= 3.5): the
    tag is a local property of this thread, so it marks the jobs submitted here (TorchDistributor
    submits its barrier job on the calling thread). A library that submits its job on a thread of
    its own under its own job group (Horovod-on-Spark) never carries the tag: its launcher names that
    group with ``adopt_job_group`` and the group's jobs count as this launch's too."""

    def __init__(self, spark):
        import secrets

        self.spark = spark
        self.connect = spark is not None and is_connect(spark)
        self.tag = f"shardtrain-launch-{secrets.token_hex(6)}"
        self.groups: list[str] = []  # job groups adopted (adopt_job_group): jobs submitted on other threads
        self._inflight: int | None = None
        self._outer = getattr(_thread_launch, "jobs", None)
        _thread_launch.jobs = self
        if spark is None:
            return
        if self.connect:
            spark.addTag(self.tag)
            if hasattr(spark, "registerProgressHandler"):  # pyspark >= 4.0 (a 3.5 client: no task state)
                spark.registerProgressHandler(self._progress)
        else:
            spark.sparkContext.addJobTag(self.tag)

    def _progress(self, stages, inflight_tasks, operation_id, done) -> None:
        self._inflight = 0 if done else int(inflight_tasks)

    def running_tasks(self) -> int | None:
        """How many of these jobs' tasks Spark runs now; None where Spark has not said."""
        if self.spark is None:
            return None
        if self.connect:
            return self._inflight
        sc = self.spark.sparkContext
        tracker = sc.statusTracker()
        running = 0
        for job in self._classic_jobs(sc):
            info = tracker.getJobInfo(job)
            for stage in (info.stageIds if info else ()):
                stage_info = tracker.getStageInfo(stage)
                running += stage_info.numActiveTasks if stage_info else 0
        return running

    def _classic_jobs(self, sc) -> list[int]:
        """This launch's running jobs: those with its tag, and those of the groups it adopted."""
        active = set(sc.statusTracker().getActiveJobsIds())
        # pyspark's StatusTracker has no getJobIdsForTag; Spark's own (3.5+) does.
        mine = set(sc._jsc.sc().statusTracker().getJobIdsForTag(self.tag))
        for group in self.groups:
            mine.update(sc.statusTracker().getJobIdsForGroup(group))
        return sorted(active & mine)

    def running_jobs(self) -> list[int]:
        """The ids of these jobs running now (classic Spark; [] on Connect, where operations are
        interrupted by tag and say themselves which they were)."""
        if self.spark is None:
            return []
        if self.connect:
            return []
        return self._classic_jobs(self.spark.sparkContext)

    def cancel(self, running: list[int] = ()) -> list[str]:
        """Cancel these jobs; returns what was cancelled, for the log: the jobs running now, and
        ``running`` (``running_jobs()`` taken earlier: a job the caller's own stop ended meanwhile,
        by killing its tasks' processes, was this cancel's as well)."""
        if self.spark is None:
            return []
        if self.connect:
            return [f"operation {op}" for op in self.spark.interruptTag(self.tag)]
        sc = self.spark.sparkContext
        jobs = sorted(set(running) | set(self._classic_jobs(sc)))
        sc.cancelJobsWithTag(self.tag)
        for group in self.groups:
            sc.cancelJobGroup(group)
        return [f"Spark job {job}" for job in jobs]

    def close(self) -> None:
        """On the launch's thread: its later jobs are no longer this launch's."""
        if _thread_launch.__dict__.get("jobs") is self:
            _thread_launch.jobs = self._outer
        if self.spark is None:
            return
        if self.connect:
            self.spark.removeTag(self.tag)
            if hasattr(self.spark, "removeProgressHandler"):
                self.spark.removeProgressHandler(self._progress)
        else:
            self.spark.sparkContext.removeJobTag(self.tag)


# The launch (LaunchJobs) open on each thread, for adopt_job_group.
_thread_launch = threading.local()


def adopt_job_group(group: str) -> None:
    """The launch open on this thread also owns the jobs of Spark job group ``group``: for a library
    that submits its job on a thread of its own, under a group it names (Horovod-on-Spark), where
    this thread's job tag does not reach. No launch open on this thread: nothing to do."""
    launch = getattr(_thread_launch, "jobs", None)
    if launch is not None:
        launch.groups.append(group)


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
    """Re-raise a bare Py4JJavaError / PythonException as SparkJobError naming ``what``; as one line
    with its own exit status where the cause is known: a file that is not Parquet, executors whose
    Python has no shardtrain (exit 2), a worker's own shardtrain error."""
    try:
        yield
    except ShardtrainError:
        raise
    except Exception as exc:  # noqa: BLE001 - we re-raise with context, never swallow
        name = type(exc).__name__
        if name in ("Py4JJavaError", "PythonException", "AnalysisException", "SparkException"):
            damaged = _NOT_PARQUET.search(str(exc))
            if damaged:  # a file whose footer Spark cannot read: the input is wrong, a retry fails the same way
                raise InputDataError(f"{what} failed: {damaged.group(0).rstrip('.')}; remove or replace that file") \
                    from None
            setup = executor_setup_error(exc, what)
            if setup is not None:
                raise setup from None
            own = worker_error(str(exc))
            if own is not None:
                raise type(own)(f"{what} failed: {own}") from None
            raise SparkJobError(f"{what} failed: {explain_java_error(exc)}") from exc
        raise


# The last line of a Python worker's traceback where it raised one of shardtrain's own errors.
_OWN_ERROR = re.compile(r"^common\.errors\.(\w+): (.+)$", re.M)


def worker_error(text: str) -> ShardtrainError | None:
    """The shardtrain error a Python worker raised on purpose (its message written for the user:
    a full disk naming the file, a bad value naming the column), found in a failed job's text, as
    that error again: its class keeps the exit status, its one line replaces the worker's
    traceback. None where the worker failed otherwise (a bug: its traceback is the message)."""
    from common import errors

    found = _OWN_ERROR.findall(text)
    if not found:
        return None
    name, message = found[-1]
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, ShardtrainError)):
        return None
    return cls(message.strip())


# A Python worker that could not import one of shardtrain's own packages (pyproject.toml's list): to
# unpickle a job's function it imports the module that defines it, so an executor whose Python has no
# shardtrain (or another version of it) fails every task this way.
_MISSING_OWN_MODULE = re.compile(r"ModuleNotFoundError: No module named '((?:common|pipelines|training|scoring|"
                                 r"shardtrain)(?:\.\w+)*)'")
EXECUTOR_SHARDTRAIN_FIX = ("install shardtrain on the executors (`make wheel` builds dist/shardtrain-<version>-py3-"
                           "none-any.whl), or point PYSPARK_PYTHON (or spark.pyspark.python) at a Python that has it")


def executors_without_shardtrain(text: str) -> str | None:
    """What a failed Spark job's ``text`` says, in words, where its Python workers could not import
    shardtrain's own modules; None otherwise. The fix: ``EXECUTOR_SHARDTRAIN_FIX``."""
    found = _MISSING_OWN_MODULE.search(text)
    if found is None:
        return None
    return f"the executors' Python cannot import shardtrain (No module named {found.group(1)!r})"


def executor_setup_error(exc: BaseException, what: str) -> ConfigError | None:
    """``what`` failed because the executors' Python has no shardtrain: one line with the fix, exit
    2 (every retry would fail the same way), instead of a page of JVM stack; None for any other
    failure. A failed job's error comes here through ``spark_errors`` and the torch launchers
    (Horovod's ranks start under its own task service, whose failure does not carry the import)."""
    missing = executors_without_shardtrain(str(exc))
    return None if missing is None else ConfigError(f"{what} failed: {missing}: {EXECUTOR_SHARDTRAIN_FIX}")


# Spark's words (parquet-mr's) for a file whose Parquet footer it cannot read; they name the file.
_NOT_PARQUET = re.compile(r"\S+ is not a Parquet file[^\n]*")


def to_spark_path(uri: str) -> str:
    """A storage URI as Spark's Hadoop file systems spell it: file:///abs for local paths, s3a:// for S3,
    /Volumes/... for a Unity Catalog volume."""
    from common.storage import is_volume_path, resolve

    loc = resolve(uri)
    if loc.scheme == "file" and is_volume_path(loc.path):
        # A volume as Databricks' Spark names it (its default file system resolves /Volumes; file:
        # access is refused on standard compute); a local Spark reads the same plain path.
        return loc.path
    if loc.scheme == "file":
        return "file://" + loc.path
    if loc.scheme == "s3":
        return "s3a://" + loc.path
    return loc.uri


def ddl_schema(spark, ddl: str):
    """A Spark DDL string ("a INT, b STRING") as a StructType (``fromDDL`` where pyspark has it)."""
    from pyspark.sql.types import StructType

    return StructType.fromDDL(ddl) if hasattr(StructType, "fromDDL") else spark.createDataFrame([], ddl).schema
