"""Airflow DAG: shard, train, then score, with the project's own ``shardtrain`` command (one task each).

Copy this file into the DAGs folder of an Airflow 2.10 or 3.x installation. Airflow and shardtrain
live in separate environments: the tasks run the ``shardtrain`` executable of the training venv
(the ``shardtrain`` param, e.g. ``/opt/shardtrain/.venv/bin/shardtrain``), with Airflow's own
Python, its ``AIRFLOW__*`` settings and its virtualenv taken out of the command's environment.

Before running anything, each task checks its ``shardtrain`` executable and ``workdir``: a missing
one fails the task at once, naming the path, without retries (a retry would find it missing too).
Exit status decides what Airflow does: 0 success (the shard step's ``output.mode=skip_if_exists``
and the score step's ``output.mode=skip_if_exists`` make a re-run of a finished date a no-op); 2 ("fix the input": a config, key, URI or column) fails
the task at once, with no retries, since a retry would fail the same way; 1 (a worker died,
storage failed, another job holds the output) is retried: ``SHARDTRAIN_DAG_RETRIES`` times (default
2), ``SHARDTRAIN_DAG_RETRY_DELAY_S`` seconds apart (default 600), from the scheduler's environment.

Params (Trigger DAG w/ config, or ``airflow dags test shardtrain DATE -c '{...}'``):

    shardtrain      the training venv's shardtrain executable
    workdir         the folder the commands run in (relative paths in the configs start there)
    shard_config    / train_config: YAML files (see conf/ in the project)
    spark_master    spark.master for both jobs (local[N], spark://host:7077, yarn, ...)
    dataset_path    / model_path: where this run's dataset and model go; "{ds}" becomes the run's
                    date; empty keeps the configs' own paths
    score_config    the score job's YAML (conf/score.yaml); empty (the default) skips scoring
    scores_path     where this run's scores go ("{ds}" as above); empty keeps the config's
    shard_overrides / train_overrides / score_overrides: more key=value overrides, e.g. ["train.epochs=3"]
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from datetime import timedelta

import pendulum

try:  # Airflow 3.x: the Task SDK
    from airflow.sdk import DAG, Param, task
    from airflow.sdk.exceptions import AirflowFailException
except ImportError:  # Airflow 2.10
    from airflow import DAG
    from airflow.decorators import task
    from airflow.exceptions import AirflowFailException
    from airflow.models.param import Param

log = logging.getLogger(__name__)

FIX_THE_INPUT = 2  # shardtrain's "bad usage, config or input" status (common/errors.py)
# Retries of status 1, from the scheduler's environment (read when the DAG file is parsed).
RETRIES = int(os.environ.get("SHARDTRAIN_DAG_RETRIES", "2"))
RETRY_DELAY = timedelta(seconds=int(os.environ.get("SHARDTRAIN_DAG_RETRY_DELAY_S", "600")))


def shardtrain_env(executable: str) -> dict[str, str]:
    """The environment for a shardtrain command: this worker's, less what belongs to Airflow's own
    Python (its venv on PATH, PYTHONPATH, its AIRFLOW__* settings, which may hold credentials),
    with the training venv's bin first on PATH, so Spark's Python workers are the training venv's."""
    airflow_bin = os.path.dirname(os.path.abspath(sys.executable))  # its venv's bin (not the realpath: /usr/bin)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("AIRFLOW__") and k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p and os.path.abspath(p) != airflow_bin]
    env["PATH"] = os.pathsep.join([os.path.dirname(executable), *path])
    return env


def check_deployment(executable: str, workdir: str, env: dict[str, str]) -> None:
    """Fail the task without retries when the ``workdir`` or ``shardtrain`` param names nothing
    usable on this worker: a retry would find it missing too, 600 s later, twice."""
    if workdir and not os.path.isdir(workdir):
        raise AirflowFailException(f"the workdir param: {workdir} {_missing_or('is not a directory', workdir)} on "
                                   "this worker; set it to the folder the shardtrain configs are in (not retried)")
    # Where the command will be looked for: a path from the workdir, a bare name on the PATH.
    if os.sep not in executable:
        problem = None if shutil.which(executable, path=env["PATH"]) else "is not on the PATH"
    else:
        executable = os.path.join(workdir, executable) if workdir else executable
        usable = os.path.isfile(executable) and os.access(executable, os.X_OK)
        problem = None if usable else _missing_or("is not an executable file", executable)
    if problem:
        raise AirflowFailException(f"the shardtrain param: {executable} {problem} on this worker; set it to the "
                                   "training venv's shardtrain, e.g. /opt/shardtrain/.venv/bin/shardtrain (not retried)")


def _missing_or(wrong: str, path: str) -> str:
    return wrong if os.path.exists(path) else "does not exist"


def run_shardtrain(executable: str, argv: list[str], workdir: str) -> None:
    """Run ``shardtrain ARGV``, its output into the task log; map its exit status for Airflow."""
    command = [executable, *argv]
    env = shardtrain_env(executable)
    check_deployment(executable, workdir, env)
    log.info("running: %s (in %s)", " ".join(command), workdir)
    proc = subprocess.Popen(command, cwd=workdir or None, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        log.info("%s", line.rstrip())
    status = proc.wait()
    if status == FIX_THE_INPUT:
        raise AirflowFailException(f"shardtrain {argv[0]} exited with status 2 (fix the input; a retry would "
                                   "fail the same way): see its error above")
    if status != 0:
        raise RuntimeError(f"shardtrain {argv[0]} exited with status {status} (may be retried)")


def dated(path: str, ds: str) -> str:
    return path.replace("{ds}", ds)


with DAG(
    dag_id="shardtrain",
    description="shard raw data into balanced Parquet shards, then train a PyTorch model on Spark",
    schedule="@daily",
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,  # two runs would train on the cluster at once
    default_args={"retries": RETRIES, "retry_delay": RETRY_DELAY},
    params={
        "shardtrain": Param("/opt/shardtrain/.venv/bin/shardtrain", type="string"),
        "workdir": Param("/opt/shardtrain", type="string"),
        "shard_config": Param("conf/shard.yaml", type="string"),
        "train_config": Param("conf/train.yaml", type="string"),
        "spark_master": Param("local[2]", type="string"),
        "dataset_path": Param("", type="string"),
        "model_path": Param("", type="string"),
        "shard_overrides": Param([], type="array"),
        "train_overrides": Param([], type="array"),
        "score_config": Param("", type="string"),
        "scores_path": Param("", type="string"),
        "score_overrides": Param([], type="array"),
    },
    tags=["shardtrain"],
) as dag:

    @task
    def shard(**context) -> str:
        """The shard job; returns the dataset path the train task reads ("" = the train config's)."""
        p, ds = context["params"], context["ds"]
        dataset = dated(p["dataset_path"], ds)
        argv = ["shard", "--config", p["shard_config"], f"spark.master={p['spark_master']}",
                "output.mode=skip_if_exists", *p["shard_overrides"]]
        if dataset:
            argv.append(f"output.path={dataset}")
        run_shardtrain(p["shardtrain"], argv, p["workdir"])
        return dataset

    @task
    def train(dataset: str, **context) -> str:
        """The training job; returns the model path the score task reads ("" = the score config's)."""
        p, ds = context["params"], context["ds"]
        model = dated(p["model_path"], ds)
        argv = ["train", "--config", p["train_config"], f"spark.master={p['spark_master']}", *p["train_overrides"]]
        if dataset:
            argv.append(f"data.path={dataset}")
        if model:
            argv.append(f"output.model_path={model}")
        run_shardtrain(p["shardtrain"], argv, p["workdir"])
        return model

    @task
    def score(model: str, **context) -> None:
        """The score job with the model just trained; nothing to do without a score_config."""
        p, ds = context["params"], context["ds"]
        if not p["score_config"]:
            log.info("no score_config param: nothing to score")
            return
        scores = dated(p["scores_path"], ds)
        argv = ["score", "--config", p["score_config"], f"spark.master={p['spark_master']}",
                "output.mode=skip_if_exists", *p["score_overrides"]]
        if model:
            argv.append(f"model={model}")
        if scores:
            argv.append(f"output.path={scores}")
        run_shardtrain(p["shardtrain"], argv, p["workdir"])

    score(train(shard()))
