"""How common.spark quiets the driver JVM it launches, without overriding what a user set.
(The effect on a real command's output is tested in tests/shardtrain/test_cli.py.)"""

from __future__ import annotations

import os

from common.errors import ConfigError
from common.spark import QUIET_LOG4J, _connect_url, _quiet_driver_logging

# Not stack: the driver's settings are built by our own code, the same on both profiles.

KEY = "spark.driver.extraJavaOptions"


def test_the_driver_jvm_gets_our_log4j2_file(monkeypatch):
    monkeypatch.delenv("PYSPARK_GATEWAY_PORT", raising=False)
    conf = _quiet_driver_logging({"spark.sql.shuffle.partitions": "8"})
    assert conf[KEY] == f"-Dlog4j2.configurationFile=file:{QUIET_LOG4J}"
    assert os.path.isfile(QUIET_LOG4J)  # shipped with the package


def test_a_users_java_options_are_kept_and_their_log4j_file_wins(monkeypatch):
    monkeypatch.delenv("PYSPARK_GATEWAY_PORT", raising=False)
    conf = _quiet_driver_logging({KEY: "-Xss4m"})
    assert conf[KEY] == f"-Xss4m -Dlog4j2.configurationFile=file:{QUIET_LOG4J}"
    own = {KEY: "-Dlog4j2.configurationFile=file:/etc/spark/log4j2.properties"}
    assert _quiet_driver_logging(own) == own


def test_a_spark_conf_value_too_long_for_the_jvm_command_line_is_refused_naming_the_key(tmp_path, capsys):
    import errno
    import subprocess

    import pytest
    import yaml

    from common.config import MAX_ARGUMENT_BYTES, MAX_CONF_BYTES
    from shardtrain.cli import main

    value = "-Dx=" + "y" * MAX_ARGUMENT_BYTES
    with pytest.raises(OSError) as raised:  # what launching the JVM with it does: exec() refuses it
        subprocess.run(["true", f"{KEY}={value}"])
    assert raised.value.errno == errno.E2BIG
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    shard = yaml.safe_load(open(os.path.join(root, "conf", "shard.yaml")))
    shard["spark"] = {"conf": {KEY: value}}
    path = tmp_path / "shard.yaml"
    path.write_text(yaml.safe_dump(shard))
    assert main(["shard", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"shardtrain: error: {path}: spark.conf.{KEY} is "), err
    assert "too long for the command line that starts Spark's JVM" in err[0]
    # Many settings, each short enough, can still be too long together.
    many = {f"spark.x.k{i}": "v" * 60_000 for i in range(MAX_CONF_BYTES // 60_000 + 1)}
    shard["spark"] = {"conf": many}
    path.write_text(yaml.safe_dump(shard))
    assert main(["shard", "--config", str(path)]) == 2
    assert "bytes in all" in capsys.readouterr().err


def test_spark_remote_and_a_different_SPARK_REMOTE_are_refused_naming_both(monkeypatch):
    import pytest

    monkeypatch.delenv("SPARK_REMOTE", raising=False)
    assert _connect_url(None) is None  # classic: spark.master
    assert _connect_url("sc://cluster:15002") == "sc://cluster:15002"
    monkeypatch.setenv("SPARK_REMOTE", "sc://a:15002")
    assert _connect_url(None) == "sc://a:15002" == _connect_url("sc://a:15002")
    with pytest.raises(ConfigError, match=r"spark.remote=sc://b:15002 and the environment's SPARK_REMOTE=sc://a:15002"):
        _connect_url("sc://b:15002")


def test_a_connect_server_on_this_machine_is_one_at_a_loopback_host():
    # What shares this machine's files (common.spark.remote_connect_host): local paths stay allowed there.
    from common.spark import _remote

    here = ["localhost", "LOCALHOST", "127.0.0.1", "127.0.1.1", "::1", "[::1]"]
    elsewhere = ["10.0.0.5", "spark-cluster.example.com", "dbc-1234.cloud.databricks.com"]
    assert [host for host in here + elsewhere if _remote(host)] == elsewhere
