"""A Spark Connect session for tests, in a child process: ``ConnectProcess`` starts this file, which
builds its session with the project's factory from ``spark.remote: local[2]`` in the config, or from
``SPARK_REMOTE=local[2]`` in its environment (``via``; either way pyspark's own local Spark Connect
server, as ``SparkSession.builder.remote("local[2]")`` starts it, offline), then runs the module-level
functions a test names, ``fn(spark, **kwargs)``, and sends back their (picklable) results or their
tracebacks.

Why a child: pyspark switches a whole process to Spark Connect (``SPARK_CONNECT_MODE_ENABLED``;
``SparkSession.active()`` and TorchDistributor follow it), and a local Connect server cannot start
beside the suite's classic session. One child per test module: its start-up costs about 40 s.
The server listens on pyspark's default port, 15002, which the client of ``remote("local")`` assumes.
"""

from __future__ import annotations

import importlib
import os
import secrets
import socket
import subprocess
import sys
import traceback
from multiprocessing.connection import Client, Listener

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CONNECT_PORT = 15002
# Set in the child by pyspark's local Connect server, or by this harness; the suite's own
# conftest allows the Spark ones.
SESSION_CONF = {"spark.sql.shuffle.partitions": 4, "spark.default.parallelism": 4, "spark.ui.enabled": False,
                "spark.driver.memory": "2g"}  # as tests/conftest.py's classic session


def connect_available() -> str | None:
    """Why Spark Connect cannot run here (pyspark 3.5 from pip has no Connect server jar), else None."""
    import pyspark

    if int(pyspark.__version__.split(".")[0]) < 4:
        return f"pyspark {pyspark.__version__} ships no Spark Connect server (pyspark 4 does)"
    for module in ("grpc", "grpc_status", "zstandard", "google.rpc"):
        try:
            importlib.import_module(module)
        except ImportError:
            return f"the Spark Connect client needs {module} (.ci/constraints-current.txt)"
    return None


class ConnectProcess:
    """The child process and its session; ``call("module:function", **kwargs)`` runs there."""

    def __init__(self, extra_paths: list[str] = (), via: str = "conf"):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", CONNECT_PORT)) == 0:
                raise AssertionError(f"port {CONNECT_PORT} is taken (another Spark Connect server?): pyspark's local "
                                     "Connect server listens there")
        authkey = secrets.token_bytes(16)
        self.listener = Listener(("127.0.0.1", 0), authkey=authkey)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, HERE, *extra_paths,
                                                            os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        if via == "env":
            env["SPARK_REMOTE"] = "local[2]"
        host, port = self.listener.address
        self.proc = subprocess.Popen([sys.executable, __file__, host, str(port), authkey.hex()], env=env)
        self.conn = self.listener.accept()
        started = self.conn.recv()
        if started[0] != "ok":
            self.close()
            raise AssertionError(f"the Spark Connect session did not start:\n{started[1]}")

    def call(self, function: str, **kwargs):
        self.conn.send((function, kwargs))
        status, value = self.conn.recv()
        if status != "ok":
            raise AssertionError(f"{function} failed in the Spark Connect process:\n{value}")
        return value

    def close(self) -> None:
        try:
            self.conn.send(None)
        except (OSError, AttributeError):
            pass
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # by its own pid
            self.proc.wait()
        self.listener.close()


def _serve(host: str, port: int, authkey: bytes) -> None:
    conn = Client((host, port), authkey=authkey)
    try:
        from common.config import SparkConfig
        from common.spark import get_or_create_session, is_connect

        remote = {} if os.environ.get("SPARK_REMOTE") else {"spark.remote": "local[2]"}
        # master=spark://nowhere: a factory that called .master beside a remote would fail here.
        spark = get_or_create_session(SparkConfig(master="spark://127.0.0.1:1", app_name="shardtrain-tests-connect",
                                                  conf={**remote, **SESSION_CONF}), log_level="ERROR")
        assert is_connect(spark), f"expected a Spark Connect session, got {type(spark)}"
    except BaseException:  # noqa: BLE001 - reported to the test
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", None))
    try:
        while True:
            request = conn.recv()
            if request is None:
                break
            function, kwargs = request
            module, _, name = function.partition(":")
            try:
                conn.send(("ok", getattr(importlib.import_module(module), name)(spark, **kwargs)))
            except BaseException:  # noqa: BLE001 - reported to the test
                conn.send(("error", traceback.format_exc()))
    finally:
        spark.stop()


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3]))
