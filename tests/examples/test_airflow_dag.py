"""examples/airflow/shardtrain_dag.py under a real Airflow 2.10 (its own venv, built by make test's setup):
``airflow dags test`` runs shard -> train -> score on local Spark with this venv's shardtrain and
publishes a model and its scores; a bad config (exit 2) fails the task at once though retries are configured; a job that
finds another writer holding its output (exit 1) is retried; a missing executable or workdir fails the task at once,
naming the path.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess

import pandas as pd
import pytest

from examples_env import EXAMPLES, ROOT, SHARDTRAIN

AIRFLOW_VERSION = "2.10.5"
AIRFLOW_VENV = os.path.join(os.environ.get("SHARDTRAIN_CACHE", os.path.expanduser("~/.cache/shardtrain")),
                            f"venv-airflow-{AIRFLOW_VERSION}")
AIRFLOW = os.path.join(AIRFLOW_VENV, "bin", "airflow")
DAG_FILE = os.path.join(EXAMPLES, "airflow", "shardtrain_dag.py")
DATE = "2026-01-02"
ROWS = 1000

pytestmark = [pytest.mark.spark, pytest.mark.process]  # a scheduler runs the commands; no ranks launched


@pytest.fixture(scope="module")
def airflow_home(tmp_path_factory):
    """A fresh AIRFLOW_HOME (SQLite) whose DAGs folder holds a copy of the example, migrated."""
    if not os.access(AIRFLOW, os.X_OK):
        pytest.fail(f"Airflow {AIRFLOW_VERSION} is not installed at {AIRFLOW_VENV}: make test sets it up, "
                    "or SHARDTRAIN_AIRFLOW=1 make setup (.ci/bootstrap builds it there)")
    home = tmp_path_factory.mktemp("airflow")
    (home / "dags").mkdir()
    shutil.copy(DAG_FILE, home / "dags")
    proc = airflow(home, "db", "migrate")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return home


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, spark):
    """What a deployment has: the project's configs, and raw data where conf/shard.yaml reads it."""
    from pipelines import generate_dataset

    work = tmp_path_factory.mktemp("deploy")
    shutil.copytree(os.path.join(ROOT, "conf"), work / "conf")
    # Few rows: the DAG's tasks are what is tested, and 1,000 rows still give the train task one
    # step of conf/train.yaml's batch (512) and every split rows to shard.
    generate_dataset(str(work / "artifacts" / "raw"), rows=ROWS, array_shape=[8], spark=spark)
    return work


def airflow_env(home, **more: str) -> dict[str, str]:
    # Airflow's environment, as a scheduler would have it: nothing of this test's Python or Spark,
    # but the suite's JVM start-up flags (SPARK_SUBMIT_OPTS, tests/jvm_start.py: its class-data
    # archive and the C1 compiler), which change how fast the tasks' Spark drivers start, never what
    # they compute or which Python and pyspark they run.
    env = {k: v for k, v in os.environ.items()
           if k == "SPARK_SUBMIT_OPTS"
           or (not k.startswith(("PYSPARK_", "SPARK_", "AIRFLOW")) and k not in ("VIRTUAL_ENV", "PYTHONPATH"))}
    env.update(AIRFLOW_HOME=str(home), AIRFLOW__CORE__LOAD_EXAMPLES="False",
               AIRFLOW__CORE__DAGS_FOLDER=str(home / "dags"), SHARDTRAIN_DAG_RETRIES="2")
    env.update(more)
    return env


def airflow(home, *args, env: dict | None = None, timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run([AIRFLOW, *args], env=airflow_env(home, **(env or {})), capture_output=True, text=True,
                          timeout=timeout)


def dags_test(home, conf: dict, env: dict | None = None) -> subprocess.CompletedProcess:
    return airflow(home, "dags", "test", "shardtrain", DATE, "--conf", json.dumps(conf), env=env)


def task_states(home) -> dict[str, tuple[str, int, int]]:
    """task_id -> (state, try_number, max_tries) of the latest run, from Airflow's own database."""
    with sqlite3.connect(home / "airflow.db") as db:
        rows = db.execute("SELECT task_id, state, try_number, max_tries FROM task_instance "
                          "WHERE dag_id = 'shardtrain' ORDER BY run_id").fetchall()
    return {task: (state, tries, max_tries) for task, state, tries, max_tries in rows}


def params(workdir, **more) -> dict:
    # local[1]: one Spark Python worker per job (each scoring one imports torch); the master is a
    # param the DAG passes through, whatever its value.
    return {"shardtrain": SHARDTRAIN, "workdir": str(workdir), "spark_master": "local[1]",
            "dataset_path": str(workdir / "datasets" / "{ds}"), "model_path": str(workdir / "models" / "{ds}"),
            # One rank in the train task's own process: what the DAG decides (exit status -> retries,
            # params, dated paths) is the same however the ranks launch (tests/training covers that).
            "train_overrides": ["train.epochs=1", "launch.mode=in_process", "launch.num_proc=1"], **more}


def test_the_dag_shards_trains_scores_and_publishes(airflow_home, workdir):
    from common.commit_marker import MARKER
    from common.publish import read_marker
    from training import load_model

    proc = dags_test(airflow_home, params(workdir, score_config="conf/score.yaml",
                                          scores_path=str(workdir / "scores" / "{ds}")))
    output = proc.stdout + proc.stderr
    assert task_states(airflow_home) == {"shard": ("success", 1, 2), "train": ("success", 1, 2),
                                         "score": ("success", 1, 2)}, output[-6000:]

    dataset, model = workdir / "datasets" / DATE, workdir / "models" / DATE
    assert (dataset / MARKER).is_file() and (model / MARKER).is_file(), output[-6000:]
    assert "output.mode=skip_if_exists" in output  # the shard step never replaces a finished date
    loaded = load_model(str(model))
    rows = pd.read_parquet(workdir / "artifacts" / "raw").head(5)
    assert loaded.predict(rows).shape == (5, 2)

    # The score task scored every raw row with this date's model (not the config's artifacts/model).
    scores = workdir / "scores" / DATE
    assert read_marker(str(scores))["kind"] == "shardtrain.scores", output[-6000:]
    accounting = json.loads((scores / "_scores.json").read_text())["accounting"]
    assert accounting["scored_rows"] + accounting["quarantined_rows"] == accounting["input_rows"] == ROWS
    assert not (workdir / "artifacts" / "model").exists()


def test_a_bad_config_fails_the_task_without_retries(airflow_home, workdir):
    # An unknown key: shardtrain exits 2 ("fix the input") before any Spark work.
    bad = workdir / "conf" / "bad-shard.yaml"
    bad.write_text((workdir / "conf" / "shard.yaml").read_text().replace("num_shards:", "num_shard:"))
    proc = dags_test(airflow_home, params(workdir, shard_config=str(bad),
                                          dataset_path=str(workdir / "datasets-bad" / "{ds}")))
    output = proc.stdout + proc.stderr

    assert "unknown key 'output.num_shard'" in output, output[-6000:]
    state, tries, max_tries = task_states(airflow_home)["shard"]
    assert (state, tries) == ("failed", 1), f"shard: {state} after {tries} try(s):\n{output[-6000:]}"
    assert max_tries == 2, "retries were configured, and exit status 2 skipped them"
    assert task_states(airflow_home)["train"][0] == "upstream_failed"
    assert not (workdir / "datasets-bad").exists()


def test_a_retryable_failure_is_retried(airflow_home, workdir):
    from common.writer_lock import output_lock

    # A real second writer: this test holds the dataset's writer lock, so every shard attempt
    # exits 1 ("is being written by pid ..."), which Airflow must retry.
    dataset = workdir / "datasets-locked" / DATE
    with output_lock(str(dataset)):
        proc = dags_test(airflow_home, params(workdir, dataset_path=str(workdir / "datasets-locked" / "{ds}")),
                         env={"SHARDTRAIN_DAG_RETRIES": "1", "SHARDTRAIN_DAG_RETRY_DELAY_S": "1"})
    output = proc.stdout + proc.stderr

    assert output.count(f"is being written by pid {os.getpid()}") >= 2, output[-6000:]
    state, tries, max_tries = task_states(airflow_home)["shard"]
    assert (state, tries, max_tries) == ("failed", 2, 1), f"shard: {state} after {tries} try(s):\n{output[-6000:]}"
    assert not (dataset / "_manifest.json").exists()


@pytest.mark.parametrize("missing", ["shardtrain", "workdir"])
def test_a_missing_executable_or_workdir_fails_the_task_without_retries(airflow_home, tmp_path, missing):
    # A path this worker does not have, as the default /opt/shardtrain/... on a worker where the
    # training venv is not installed. Retries are configured, 1 s apart, so a retried task would
    # show here as a second try.
    absent = tmp_path / "not-deployed" / ("bin/shardtrain" if missing == "shardtrain" else "work")
    conf = {"shardtrain": SHARDTRAIN, "workdir": str(tmp_path), missing: str(absent)}
    proc = dags_test(airflow_home, conf, env={"SHARDTRAIN_DAG_RETRIES": "2", "SHARDTRAIN_DAG_RETRY_DELAY_S": "1"})
    output = proc.stdout + proc.stderr

    assert f"the {missing} param: {absent} does not exist on this worker" in output, output[-6000:]
    assert "FileNotFoundError" not in output, output[-6000:]
    state, tries, max_tries = task_states(airflow_home)["shard"]
    assert (state, tries, max_tries) == ("failed", 1, 2), f"shard: {state} after {tries} try(s):\n{output[-6000:]}"
    assert task_states(airflow_home)["train"][0] == "upstream_failed"
