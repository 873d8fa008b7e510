"""Fixtures shared by every test: one local SparkSession per test session, one tiny generated and
sharded dataset, a standalone cluster on loopback when a test asks for one, and a guard that tests leave no env vars behind.
Also the suite's runner plumbing: the seconds per test file at the end of every run, and how
pytest-xdist's workers (``-n N --dist loadfile``) share the tests out (see ``pytest_xdist_make_scheduler``),
and cheaper driver JVM start-ups for every process the tests start (tests/jvm_start.py).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections import defaultdict

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/spark_cluster.py, tests/polling.py

import jvm_start  # noqa: E402
from polling import wait_for  # noqa: E402
from spark_cluster import start_cluster  # noqa: E402


def pytest_configure(config):
    # Before any test or fixture starts a JVM, and inherited by every process the tests start.
    config._shardtrain_jvm_start = jvm_start.configure()


@pytest.fixture(scope="session")
def spark(tmp_path_factory):
    """A real local[2] SparkSession, shared: start-up costs 5-10 s. Its warehouse is this test
    session's own (not ./spark-warehouse), so xdist workers never share a table directory."""
    from common.config import SparkConfig
    from common.spark import get_or_create_session

    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    conf = {"spark.sql.shuffle.partitions": 4, "spark.default.parallelism": 4, "spark.ui.enabled": False,
            "spark.driver.memory": "2g", "spark.sql.warehouse.dir": str(tmp_path_factory.mktemp("spark-warehouse"))}
    session = get_or_create_session(SparkConfig(master="local[2]", app_name="shardtrain-tests", conf=conf),
                                    log_level="ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def generated_dataset(spark, tmp_path_factory):
    """The suite's tiny generated dataset, made and sharded once per session (a generate job and a shard
    job cost seconds of fixed Spark work, whatever the rows): 3,000 rows of pipelines.generate (4 numeric
    and 2 categorical features, an array column, 3 classes, 40 bad rows) through the real shard job, 3
    files per split and 300-row row groups. ``(data, cfg, result)``: the GeneratedDataset, the
    ShardConfig and the ShardResult. tests/pipelines/test_shard_job.py checks it (and re-runs the job over
    it, to the same bytes); a test that damages it works on a copy."""
    from common.config import from_dict
    from pipelines.generate import generate_dataset
    from pipelines.shard_config import ShardConfig
    from pipelines.shard_job import run_shard_job

    root = tmp_path_factory.mktemp("gen")
    data = generate_dataset(spark, str(root / "raw"), 3000, seed=7, array_shape=[2, 3], num_classes=3, bad_rows=40)
    cfg = from_dict(ShardConfig, data.shard_config(str(root / "out"), output={"num_shards": 3, "rows_per_row_group": 300},
                                                   quality={"max_bad_fraction": 0.05},
                                                   features={"numeric": data.numeric + ["id"]}))
    return data, cfg, run_shard_job(spark, cfg)


# The image dataset's shard config (beside the folder, label and output paths the fixture fills in):
# class labels from the folder names through the query, classes fitted on train.
IMAGE_QUERY = ("SELECT path, content, regexp_extract(path, '/([^/]+)/[^/]+$', 1) AS label FROM pics")


@pytest.fixture(scope="session")
def image_dataset(spark, tmp_path_factory):
    """The suite's tiny image dataset, sharded once per session: tests/image_files.py's folder (3
    class folders of 24 PNG/JPEG 24 px images, and the odd files: truncated, text named .jpg, a
    header claiming 100,000 x 100,000 pixels, 1x1, 16-bit, CMYK, gray, palette+alpha,
    EXIF-rotated) read by ``binaryFile``, labels from the path, stored as 16 x 16 RGB PNG, 2 files
    per split. ``(folder, expected, cfg, result)``: the folder, {file path: the rule it is
    quarantined for, or None}, the ShardConfig and the ShardResult. tests/pipelines/test_shard_images.py
    checks it and re-runs it; a test that damages it works on a copy."""
    import image_files

    from common.config import from_dict
    from pipelines.shard_config import ShardConfig
    from pipelines.shard_job import run_shard_job

    root = tmp_path_factory.mktemp("images")
    folder = root / "photos"
    expected = image_files.write_image_folder(folder)
    cfg = from_dict(ShardConfig, {
        "sources": {"pics": {"path": str(folder), "format": "binaryFile",
                             "options": {"recursiveFileLookup": True, "pathGlobFilter": "*.{png,jpg}"}}},
        "query": IMAGE_QUERY,
        "features": {"images": {"content": {"size": [16, 16], "format": "png"}}},
        "label": {"column": "label", "classes": "auto"},
        "split": {"key": "regexp_extract(path, '[^/]+/[^/]+$', 0)", "fractions": {"train": 0.7, "val": 0.15, "test": 0.15}},
        "output": {"path": str(root / "shards"), "num_shards": 2, "row_group_mb": 0.01},
        "quality": {"max_bad_fraction": 0.1}})
    return folder, expected, cfg, run_shard_job(spark, cfg)


@pytest.fixture(scope="session")
def standalone_cluster():
    """A Spark master and two 1-core workers on 127.0.0.1, each offering one fake GPU (addresses 0
    and 1); yields the cluster (see spark_cluster.py)."""
    cluster = start_cluster(num_workers=2, cores=1, memory="2g", fake_gpus=True)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def s3_endpoint():
    """An S3 endpoint over real HTTP on 127.0.0.1: moto's server in a subprocess, stopped by pid."""
    exe = shutil.which("moto_server", path=os.path.dirname(sys.executable))
    assert exe, "moto_server is not installed in this venv; run .ci/bootstrap"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _answers(url), f"the moto S3 server to answer at {url}", timeout=30, proc=proc, interval=0.2)
    except AssertionError:
        proc.kill()
        raise
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=1)
        return True
    except OSError:
        return False


@pytest.fixture
def s3_bucket(s3_endpoint, monkeypatch):
    """A fresh bucket on the loopback S3 endpoint, with credentials and endpoint in the environment."""
    from common import storage

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("SHARDTRAIN_S3_ENDPOINT", s3_endpoint)
    storage._FS_CACHE.clear()
    fs = storage.resolve("s3://shardtrain-test").fs
    fs.mkdir("shardtrain-test")
    yield "s3://shardtrain-test"
    fs.rm("shardtrain-test", recursive=True)
    storage._FS_CACHE.clear()


class SmallDisk:
    """A real 256 KiB tmpfs at ``path``; ``fill()`` takes its free space."""

    def __init__(self, path):
        self.path = path

    def fill(self, leave_bytes: int = 0) -> None:
        """Fill the disk, then give back ``leave_bytes`` (whole 4 KiB pages, as tmpfs counts)."""
        import errno

        filler = os.path.join(self.path, "filler")
        try:
            with open(filler, "wb", buffering=0) as fh:
                while True:
                    fh.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
        os.truncate(filler, max(0, os.path.getsize(filler) - leave_bytes))


@pytest.fixture
def small_disk(tmp_path):
    """A real file system that a test can fill: a 256 KiB tmpfs mounted on a fresh directory (root
    may mount one; the tests run as root here and in CI), unmounted after the test. A write past its
    room fails in the kernel with ENOSPC, as on a real full disk."""
    mount_point = tmp_path / "small-disk"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount_point)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs for a full-disk test (run the tests as root): {mounted.stderr.strip()}")
    try:
        yield SmallDisk(mount_point)
    finally:
        subprocess.run(["umount", "--lazy", str(mount_point)], check=False)


@pytest.fixture
def executors_without_shardtrain(spark, tmp_path):
    """The shared session's Python workers run, for this test, a Python that has every package of
    this venv but shardtrain: this interpreter's base Python with the venv's site-packages on
    PYTHONPATH (so the editable install's .pth finder is never read), without site (-S) or the
    working directory (-P) on its path. Spark's spark.sql.execution.pyspark.python (runtime) picks
    it for Python UDFs and pandas function APIs. Yields the wrapper's path; the setting is put back."""
    import sysconfig

    wrapper = tmp_path / "python-without-shardtrain"
    site_packages = sysconfig.get_paths()["purelib"]
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={site_packages} exec {sys._base_executable} -S -P "$@"\n')
    wrapper.chmod(0o755)
    key = "spark.sql.execution.pyspark.python"
    before = spark.conf.get(key, None)
    spark.conf.set(key, str(wrapper))
    try:
        yield str(wrapper)
    finally:
        if before is None:
            spark.conf.unset(key)
        else:
            spark.conf.set(key, before)


# Set on purpose by the session fixtures above and by Spark itself, and kept for later tests;
# PYTEST_CURRENT_TEST is pytest's own (it names the running phase); torch sets TORCHINDUCTOR_CACHE_DIR
# on its first optimizer step in a process (torch's doing, in whichever test trains first; a session
# fixture that took that step up front made every test file under tests/training import torch).
ENV_SET_ON_PURPOSE = {"PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "SPARK_LOCAL_IP", "SPARK_HOME", "PYSPARK_GATEWAY_PORT",
                      "PYSPARK_GATEWAY_SECRET", "SPARK_AUTH_SOCKET_TIMEOUT", "SPARK_BUFFER_SIZE", "PYTHONHASHSEED",
                      "PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"}


@pytest.fixture(autouse=True)
def _no_env_leak():
    """A test that adds, removes or changes an environment variable fails; either way the
    environment is put back, so one leak does not change (or fail) the tests after it."""
    before = dict(os.environ)
    yield
    after = dict(os.environ)
    leaked = sorted(k for k in set(before) | set(after)
                    if before.get(k) != after.get(k) and k not in ENV_SET_ON_PURPOSE)
    for key in leaked:
        if key in before:
            os.environ[key] = before[key]
        else:
            del os.environ[key]
    assert not leaked, f"test leaked environment variables: {leaked}"


def pytest_collection_modifyitems(config, items):
    """Tests that start worker JVMs (a standalone cluster, or Spark's local-cluster master) must be
    marked ``cluster``, so ``-m "not cluster"`` (make test-fast) really leaves them out."""
    unmarked = [item.nodeid for item in items if _starts_cluster(item) and item.get_closest_marker("cluster") is None]
    if unmarked:
        raise pytest.UsageError("these tests start a Spark cluster but are not marked @pytest.mark.cluster: "
                                + ", ".join(unmarked))


def _starts_cluster(item) -> bool:
    import inspect

    if "standalone_cluster" in getattr(item, "fixturenames", ()):
        return True
    func = getattr(item, "function", None)
    try:
        source = inspect.getsource(func) if func is not None else ""
    except (OSError, TypeError):
        return False
    return "local-cluster[" in source or "spark://" in source


# --- the suite on parallel workers (pytest-xdist) ---------------------------------------------------

# Test files that must never run in two workers at once, found by what their source names: pyspark's
# local Spark Connect server always binds port 15002, so two cannot start; and the standalone cluster
# (a master, two worker JVMs and their executors) is started once, by the one worker that runs its
# files, instead of by every worker that meets one of them, each holding it to the end of its session.
# The files that read the session's one TorchDistributor run (``uneven_torch_run``) share a worker for
# the same reason: on two workers each launched it (test_torchrun's setup took 52 s instead of 0).
WORKER_GROUPS = {"spark-connect": "ConnectProcess(", "spark-cluster": "standalone_cluster",
                 "uneven-torch-run": "uneven_torch_run"}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``-n N --dist loadfile``: xdist sends each file to one worker (its module-scoped datasets and
    rank launches are not run twice), and here the files of one ``WORKER_GROUPS`` group go as one
    unit. The group is read from each file's source on the controller, which collects nothing
    itself; xdist's own ``xdist_group`` marks are not used: with pytest 9 (the current profile)
    xdist 3.8.0 cannot add the group to the node id, and the grouping is silently lost.

    Units go out heaviest first (``unit_weight``), not in xdist's order (most tests first): that
    order sent the few-test files whose tests launch ranks, clusters and processes (test_failures,
    test_pipeline_failures, the standalone cluster's group) last, so one worker ran one of them
    alone at the end while the other waited."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    groups: dict[str, str] = {}
    sizes: dict[str, int] = {}

    def source(path: str) -> str:
        try:
            return (config.rootpath / path).read_text(errors="replace")
        except OSError:
            return ""

    def group_of(path: str) -> str:
        if path not in groups:
            text = source(path)
            sizes[path] = len(text)
            groups[path] = next((name for name, marker in WORKER_GROUPS.items() if marker in text), path)
        return groups[path]

    class FileOrGroupScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid.split("::", 1)[0])

        def _assign_work_unit(self, node) -> None:
            heaviest = max(self.workqueue, key=lambda scope: unit_weight(self.workqueue[scope], sizes))
            self.workqueue.move_to_end(heaviest, last=False)  # the parent hands out the first unit
            super()._assign_work_unit(node)

    return FileOrGroupScheduling(config, log)


def unit_weight(nodeids, sizes: dict[str, int]) -> int:
    """A guess, before anything ran, at how long a unit of files takes: the size of their source.
    The suite's long tests are its end-to-end ones, and a file of them carries their helpers,
    fixtures and docstrings; the tests' own marks (``ranks``, ``process``, ...) guessed no better.
    Checked against the seconds per file of a whole run (benchmarks/RESULTS.md, "The suite's time in
    the reshape"): both profiles' workers then end within seconds of each other."""
    return sum(sizes.get(path, 0) for path in {nodeid.split("::", 1)[0] for nodeid in nodeids})


# --- time by file, printed at the end of every run ----------------------------------------------------

_SECONDS_BY_FILE: dict[str, float] = defaultdict(float)
_RUN_STARTED = time.monotonic()
TIME_BY_FILE_SHOWN = 40


def pytest_runtest_logreport(report):
    """Setup, call and teardown of every test, summed per file. Under xdist the workers' reports
    reach the controller through this same hook, so the sum there covers every worker."""
    _SECONDS_BY_FILE[report.nodeid.split("::", 1)[0]] += report.duration


def pytest_terminal_summary(terminalreporter, config):
    if hasattr(config, "workerinput") or not _SECONDS_BY_FILE:  # an xdist worker: the controller prints
        return
    ranked = sorted(_SECONDS_BY_FILE.items(), key=lambda kv: kv[1], reverse=True)
    total = sum(_SECONDS_BY_FILE.values())
    shown = ranked[:TIME_BY_FILE_SHOWN]
    title = f"time by test file (setup+call+teardown), top {len(shown)} of {len(ranked)} files"
    terminalreporter.write_sep("=", title)
    for path, seconds in shown:
        terminalreporter.write_line(f"{seconds:9.1f} s  {100 * seconds / total if total else 0:5.1f}%  {path}")
    workers = getattr(config.option, "numprocesses", None) or 0
    terminalreporter.write_line(f"{total:9.1f} s  in all test files, {time.monotonic() - _RUN_STARTED:.1f} s wall"
                                + (f" on {workers} xdist workers" if workers else ""))
    if getattr(config, "_shardtrain_jvm_start", None):
        terminalreporter.write_line(config._shardtrain_jvm_start)
