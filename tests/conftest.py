"""Fixtures shared by every test: one local SparkSession per test session, a standalone
cluster on loopback when a test asks for one, and a guard that tests leave no env vars behind.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/spark_cluster.py

from spark_cluster import start_cluster  # noqa: E402


@pytest.fixture(scope="session")
def spark():
    """A real local[2] SparkSession, shared: start-up costs 5-10 s."""
    from pyspark.sql import SparkSession

    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    session = (SparkSession.builder.master("local[2]").appName("shardtrain-tests")
               .config("spark.sql.shuffle.partitions", "4")
               .config("spark.default.parallelism", "4")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.sql.session.timeZone", "UTC")
               .config("spark.driver.memory", "2g")
               .getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def standalone_cluster():
    """A Spark master and two 1-core workers on 127.0.0.1; yields the cluster (see spark_cluster.py)."""
    cluster = start_cluster(num_workers=2, cores=1, memory="2g")
    yield cluster
    cluster.stop()


@pytest.fixture(autouse=True)
def _no_env_leak():
    before = dict(os.environ)
    yield
    # Spark and our own fixtures set a few on purpose; anything else a test set is a leak.
    allowed = {"PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "SPARK_LOCAL_IP", "SPARK_HOME", "PYSPARK_GATEWAY_PORT",
               "PYSPARK_GATEWAY_SECRET", "SPARK_AUTH_SOCKET_TIMEOUT", "SPARK_BUFFER_SIZE", "PYTHONHASHSEED"}
    leaked = {k for k in set(os.environ) ^ set(before) if k not in allowed}
    assert not leaked, f"test leaked environment variables: {sorted(leaked)}"
