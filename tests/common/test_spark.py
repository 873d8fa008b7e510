"""How common.spark quiets the driver JVM it launches, without overriding what a user set.
(The effect on a real command's output is tested in tests/shardtrain/test_cli.py.)"""

from __future__ import annotations

import os

from common.spark import QUIET_LOG4J, _quiet_driver_logging

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
