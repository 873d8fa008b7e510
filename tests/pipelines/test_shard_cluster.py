"""The shard job under spark-submit on a real standalone cluster (master + two 1-core workers on
127.0.0.1) writes the same bytes as in local mode (local[2]), even when an executor JVM is killed
while it runs one of the job's tasks: one spark-submit proves both."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipelines.generate import generate_dataset
from polling import wait_for
from shard_slow import GATE_ENV, RELEASE
from shard_testdata import file_hashes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from spark_cluster import spark_env  # noqa: E402

pytestmark = [pytest.mark.spark, pytest.mark.cluster]

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "shardtrain" / "job.py"


@pytest.fixture(scope="module")
def job_input(spark, tmp_path_factory):
    root = tmp_path_factory.mktemp("submit")
    # JSON with malformed lines and an array column: every path of the job runs on the executors.
    data = generate_dataset(spark, str(root / "raw"), 4000, seed=3, format="json", array_shape=[4],
                            num_classes=3, bad_rows=25, partitions=6)
    cfg = data.shard_config(str(root / "out"), output={"num_shards": 3, "rows_per_row_group": 250},
                            quality={"max_bad_fraction": 0.05})
    cfg["spark"] = {"conf": {"spark.sql.shuffle.partitions": 4, "spark.ui.enabled": False}}
    path = root / "shard.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return root, path


def submit(master: str, config: Path, overrides: list[str], log: Path, py_files: list[str] = (),
           env: dict | None = None) -> subprocess.Popen:
    """spark-submit the shard job; its output goes to ``log`` (a pipe nobody reads while the
    test waits could fill up and stall the driver)."""
    env = {**spark_env(), **(env or {})}
    cmd = [os.path.join(env["SPARK_HOME"], "bin", "spark-submit"), "--master", master,
           "--conf", "spark.task.maxFailures=4", "--conf", "spark.ui.enabled=false",
           "--conf", "spark.executor.memory=1g"]
    if py_files:
        cmd += ["--py-files", ",".join(py_files)]
    # -v: Spark logs at INFO again, which is how this test sees where the executors ran.
    cmd += [str(JOB), "-v", "shard", "--config", str(config), *overrides]
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, env=env, cwd=str(ROOT), stdout=out, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, log: Path, timeout: float = 400) -> str:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"spark-submit did not finish in {timeout}s:\n{log.read_text(errors='replace')[-4000:]}")
    out = log.read_text(errors="replace")
    assert proc.returncode == 0, f"spark-submit failed ({proc.returncode}):\n{out[-4000:]}"
    return out


def parent_pid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # fields after "(comm)": state, ppid, ...


def is_dead(pid: int) -> bool:
    """Gone, or a zombie waiting for its parent (the Spark worker) to reap it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def executor_running(python_pid: int, executors: list[int]) -> int | None:
    """The executor JVM among ``executors`` that a task's Python worker descends from."""
    pid = python_pid
    while pid and pid > 1:
        if pid in executors:
            return pid
        pid = parent_pid(pid)
    return None


def assert_ran_on_cluster(log: str) -> None:
    # spark-submit --master must win over the config's spark.master (local[2] by default).
    assert "Granted executor ID" in log and "Starting executor ID driver" not in log, log[-3000:]


@pytest.fixture(scope="module")
def local_hashes(job_input):
    """The reference: the same job in local mode, through the CLI's ``main`` in this process on the
    tests' local[2] session (the process boundary under test is the cluster's spark-submit below;
    a spark-submit of local[2] would start one more JVM to write the same bytes)."""
    from shardtrain.cli import main as shardtrain

    root, config = job_input
    out = root / "local"
    assert shardtrain(["shard", "--config", str(config), f"output.path={out}"]) == 0
    return file_hashes(str(out))


def test_killing_an_executor_mid_job_still_gives_the_same_files(job_input, local_hashes, standalone_cluster, tmp_path):
    # One spark-submit carries both: the job under spark-submit on the cluster (its --master winning
    # over the config's local[2]) writes local mode's bytes, and it still does with an executor JVM
    # killed while it runs one of the job's tasks. The gated transform passes every row through.
    root, config = job_input
    out, log, gate = root / "fault", tmp_path / "fault.log", tmp_path / "gate"
    gate.mkdir()
    # Every task of the job's first pass over the input waits at the gate (shard_slow.py) until released.
    proc = submit(standalone_cluster.master_url, config, [f"output.path={out}", "transform=shard_slow:gated"], log,
                  py_files=[str(Path(__file__).with_name("shard_slow.py"))], env={GATE_ENV: str(gate)})
    try:
        # Polled every 0.2 s: each look at the executors runs ps.
        marker = wait_for(lambda: next(iter(sorted(gate.glob("started-*.pid"))), None), "a task at the gate",
                          timeout=300, proc=proc, log=log, interval=0.2)
        task_pid = int(marker.read_text())
        killed = wait_for(lambda: executor_running(task_pid, standalone_cluster.executor_pids()),
                          f"the executor JVM above the task's Python worker (pid {task_pid})", timeout=300,
                          proc=proc, log=log, interval=0.2)
        os.kill(killed, signal.SIGKILL)
        wait_for(lambda: is_dead(killed), f"the death of executor pid {killed}", timeout=60, proc=proc, log=log,
                 interval=0.2)
        assert proc.poll() is None  # the job is still running: its task was held at the gate
        (gate / RELEASE).touch()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    text = finish(proc, log)
    assert_ran_on_cluster(text)
    assert killed not in standalone_cluster.executor_pids()
    assert "Lost executor" in text or "EXITED" in text, text[-3000:]  # Spark saw the executor die
    assert file_hashes(str(out)) == local_hashes
    assert len(local_hashes) == 3 * 3 + 1  # 3 splits x 3 shards + the quarantine
    assert "published" in text
