"""A real Spark standalone cluster on 127.0.0.1: one master and N one-core workers, started from
pip's pyspark with ``spark-class`` and stopped by pid. Used by the tests' ``standalone_cluster``
fixture and by benchmarks; never by shardtrain itself.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from polling import wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def refused_port() -> int:
    """A loopback port nothing listens on, proven by a refused connection."""
    port = free_port()
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return port
    raise AssertionError(f"127.0.0.1:{port} accepted a connection; a test needs a port nothing listens on")


def spark_env() -> dict:
    import pyspark

    env = dict(os.environ)
    env["SPARK_HOME"] = os.path.dirname(pyspark.__file__)
    env["PYSPARK_PYTHON"] = sys.executable
    env["PYSPARK_DRIVER_PYTHON"] = sys.executable
    env["SPARK_LOCAL_IP"] = "127.0.0.1"
    return env


@dataclass
class StandaloneCluster:
    master_url: str
    web_url: str
    work_dir: Path
    master: subprocess.Popen
    workers: list[subprocess.Popen] = field(default_factory=list)

    def status(self) -> dict:
        with urllib.request.urlopen(f"{self.web_url}/json/", timeout=5) as resp:
            return json.loads(resp.read())

    def alive_workers(self) -> int:
        return sum(1 for w in self.status().get("workers", []) if w.get("state") == "ALIVE")

    def executor_pids(self) -> list[int]:
        """PIDs of executor JVMs (CoarseGrainedExecutorBackend) launched by this cluster's workers."""
        worker_pids = {w.pid for w in self.workers}
        # -ww: without a terminal (pytest captures output) ps cuts lines at 80 columns and the
        # class name falls off.
        out = subprocess.run(["ps", "-ww", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout
        pids = []
        for line in out.splitlines()[1:]:
            parts = line.strip().split(None, 2)
            if len(parts) == 3 and int(parts[1]) in worker_pids and "CoarseGrainedExecutorBackend" in parts[2]:
                pids.append(int(parts[0]))
        return pids

    def stop(self) -> None:
        for proc in [*self.workers, self.master]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.time() + 20
        for proc in [*self.workers, self.master]:
            try:
                proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        # The daemons' logs and the workers' folders (each application's jars, stdout and stderr): the
        # tests that read them have run by now, and a suite run must not leave them in /tmp.
        shutil.rmtree(self.work_dir, ignore_errors=True)


def start_cluster(num_workers: int = 2, cores: int = 1, memory: str = "2g", timeout: float = 90,
                  fake_gpus: bool = False) -> StandaloneCluster:
    """``fake_gpus``: each worker offers one GPU resource, worker i the address ``str(i)`` (its own
    discovery script): an application that asks for GPUs gets each task its own address, though
    nothing here has CUDA; one that does not ask is scheduled as before."""
    env = spark_env()
    if "-XX:TieredStopAtLevel=1" in env.get("SPARK_SUBMIT_OPTS", ""):
        # The suite's quicker JVM start-ups (tests/jvm_start.py: its class-data archive of the same
        # jars, and C1) for the master, the workers and the executors they launch (which inherit a
        # worker's environment). Not for drivers: the java launcher announces JDK_JAVA_OPTIONS on
        # stderr, which these daemons send to their logs.
        env["JDK_JAVA_OPTIONS"] = env["SPARK_SUBMIT_OPTS"]
    spark_class = os.path.join(env["SPARK_HOME"], "bin", "spark-class")
    port, web_port = free_port(), free_port()
    work_dir = Path(tempfile.mkdtemp(prefix="shardtrain-cluster-"))
    logs = work_dir / "logs"
    logs.mkdir()
    master = subprocess.Popen(
        [spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
         "--webui-port", str(web_port)],
        env=env, stdout=open(logs / "master.log", "wb"), stderr=subprocess.STDOUT)
    cluster = StandaloneCluster(master_url=f"spark://127.0.0.1:{port}", web_url=f"http://127.0.0.1:{web_port}",
                                work_dir=work_dir, master=master)
    try:
        # Polled every 0.5 s: each look asks the master's web UI.
        wait_for(lambda: _reachable(cluster), "the Spark master", timeout, proc=master, log=logs / "master.log",
                 interval=0.5)
        for i in range(num_workers):
            wdir = work_dir / f"worker{i}"
            wdir.mkdir()
            worker_env = env
            if fake_gpus:
                worker_env = dict(env, SPARK_WORKER_OPTS=_fake_gpu_options(work_dir / f"gpus-worker{i}.sh", str(i)))
            cluster.workers.append(subprocess.Popen(
                [spark_class, "org.apache.spark.deploy.worker.Worker", cluster.master_url, "--host", "127.0.0.1",
                 "--cores", str(cores), "--memory", memory, "--work-dir", str(wdir), "--webui-port", "0"],
                env=worker_env, stdout=open(logs / f"worker{i}.log", "wb"), stderr=subprocess.STDOUT))
        wait_for(lambda: _alive_workers(cluster) == num_workers, f"{num_workers} Spark workers", timeout,
                 log=logs / "worker0.log", interval=0.5)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _fake_gpu_options(script: Path, address: str) -> str:
    """A worker's Java options for one GPU at ``address``, found by its own discovery ``script``."""
    script.write_text(f'#!/bin/sh\necho \'{{"name": "gpu", "addresses": ["{address}"]}}\'\n')
    script.chmod(0o755)
    return f"-Dspark.worker.resource.gpu.amount=1 -Dspark.worker.resource.gpu.discoveryScript={script}"


def _reachable(cluster: StandaloneCluster) -> bool:
    try:
        cluster.status()
        return True
    except OSError:
        return False


def _alive_workers(cluster: StandaloneCluster) -> int:
    """The workers the master lists as alive; 0 while its web UI does not answer."""
    try:
        return cluster.alive_workers()
    except OSError:
        return 0
