"""The shard job under spark-submit: on local[2] and on a real standalone cluster (master + two
1-core workers on 127.0.0.1) it writes the same bytes, and it still does when an executor JVM is
killed in the middle of the job."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipelines.generate import generate_dataset
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


def submit(master: str, config: Path, overrides: list[str], py_files: list[str] = (), timeout: float = 400):
    env = spark_env()
    cmd = [os.path.join(env["SPARK_HOME"], "bin", "spark-submit"), "--master", master,
           "--conf", "spark.task.maxFailures=4", "--conf", "spark.ui.enabled=false",
           "--conf", "spark.executor.memory=1g"]
    if py_files:
        cmd += ["--py-files", ",".join(py_files)]
    cmd += [str(JOB), "shard", "--config", str(config), *overrides]
    return subprocess.Popen(cmd, env=env, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout: float = 400) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"spark-submit did not finish in {timeout}s:\n{out[-4000:]}")
    assert proc.returncode == 0, f"spark-submit failed ({proc.returncode}):\n{out[-4000:]}"
    return out


def assert_ran_on_cluster(log: str) -> None:
    # spark-submit --master must win over the config's spark.master (local[2] by default).
    assert "Granted executor ID" in log and "Starting executor ID driver" not in log, log[-3000:]


@pytest.fixture(scope="module")
def local_hashes(job_input):
    root, config = job_input
    out = root / "local"
    finish(submit("local[2]", config, [f"output.path={out}"]))
    return file_hashes(str(out))


def test_standalone_cluster_writes_the_same_files_as_local_mode(job_input, local_hashes, standalone_cluster):
    root, config = job_input
    out = root / "cluster"
    log = finish(submit(standalone_cluster.master_url, config, [f"output.path={out}"]))
    assert "published" in log
    assert_ran_on_cluster(log)
    assert file_hashes(str(out)) == local_hashes
    assert len(local_hashes) == 3 * 3 + 1  # 3 splits x 3 shards + the quarantine


def test_killing_an_executor_mid_job_still_gives_the_same_files(job_input, local_hashes, standalone_cluster):
    root, config = job_input
    out = root / "fault"
    proc = submit(standalone_cluster.master_url, config, [f"output.path={out}", "transform=shard_slow:sleepy"],
                  py_files=[str(Path(__file__).with_name("shard_slow.py"))])
    killed = None
    try:
        start = time.time()
        deadline = start + 180
        while time.time() < deadline and proc.poll() is None:
            pids = standalone_cluster.executor_pids()
            if len(pids) == 2:
                break
            time.sleep(0.5)
        # The sleepy transform makes every pass over the input take several seconds; the job makes
        # five passes, so 12 s after the executors start it is well inside the job.
        time.sleep(12)
        if proc.poll() is not None:
            pytest.fail("the job finished before the executor could be killed; slow it down:\n"
                        + proc.communicate()[0][-3000:])
        killed = standalone_cluster.executor_pids()[0]
        os.kill(killed, 9)
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    log = finish(proc)
    assert_ran_on_cluster(log)
    assert killed not in standalone_cluster.executor_pids()
    assert "Lost executor" in log or "EXITED" in log, log[-3000:]  # Spark saw the executor die
    assert file_hashes(str(out)) == local_hashes
    assert "published" in log
