"""The `shardtrain` command as a scheduler sees it: bad input fails before any work with one line
naming the file, key or URI, and exit status 2 (usage/config), distinct from 1 (runtime)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

SHARDTRAIN = os.path.join(os.path.dirname(sys.executable), "shardtrain")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # test_readme's noise patterns


def shardtrain(*args, env=None):
    proc = subprocess.run([SHARDTRAIN, *args], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, **(env or {})})
    return proc.returncode, proc.stderr.strip().splitlines()


def _error_line(lines):
    errors = [line for line in lines if line.startswith("shardtrain: error:")]
    assert len(errors) == 1, lines  # exactly one line for the user, no traceback
    assert not any(line.startswith("Traceback") for line in lines), lines
    return errors[0]


@pytest.mark.parametrize("command", ["shard", "train", "run", "distill"])
def test_missing_config_file(command):
    code, lines = shardtrain(command, "--config", "conf/nope.yaml")
    assert code == 2
    assert _error_line(lines) == "shardtrain: error: config file not found: conf/nope.yaml"


def test_malformed_yaml_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sources:\n  raw: {path: x\nlabel: [\n")
    code, lines = shardtrain("shard", "--config", str(bad))
    assert code == 2
    assert f"malformed YAML in {bad} line" in _error_line(lines)


def test_unknown_key_and_wrong_type():
    code, lines = shardtrain("train", "--config", "conf/train.yaml", "train.batch_sise=64")
    assert code == 2
    assert _error_line(lines).endswith("unknown key 'train.batch_sise'; did you mean 'train.batch_size'?")
    code, lines = shardtrain("train", "--config", "conf/train.yaml", "train.epochs=three")
    assert code == 2
    assert "train.epochs must be an integer, got 'three' (str)" in _error_line(lines)


def test_bad_uri_scheme_fails_before_spark_starts():
    code, lines = shardtrain("shard", "--config", "conf/shard.yaml", "output.path=gs://bucket/ds")
    assert code == 2
    assert _error_line(lines) == ("shardtrain: error: gs://bucket/ds: unsupported URI scheme 'gs'; use a local path, "
                                  "file://, s3://, hdfs:// or dbfs:/")
    assert not any("SparkContext" in line or "WARN" in line for line in lines)  # Spark never started


def test_s3_without_credentials_fails_before_spark_starts(tmp_path):
    env = {"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"), "AWS_CONFIG_FILE": str(tmp_path / "none"),
           "AWS_EC2_METADATA_DISABLED": "true", "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""}
    code, lines = shardtrain("run", "--config", "conf/run.yaml", "shard.output.path=s3://bucket/ds", env=env)
    assert code == 2
    assert "s3://bucket/ds: no AWS credentials found" in _error_line(lines)


def test_train_refuses_a_missing_dataset_before_launching(tmp_path):
    code, lines = shardtrain("train", "--config", "conf/train.yaml", f"data.path={tmp_path}/none")
    assert code == 2
    assert f"{tmp_path}/none: no such dataset" in _error_line(lines)


def test_usage_errors_exit_2():
    proc = subprocess.run([SHARDTRAIN, "shard"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--config" in proc.stderr
    proc = subprocess.run([SHARDTRAIN, "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("shardtrain ")


# --- quiet by default: only shardtrain's own lines, the first naming version and config ---------

@pytest.fixture(scope="module")
def tiny_raw(spark, tmp_path_factory):
    from pipelines.generate import generate_dataset

    path = str(tmp_path_factory.mktemp("quiet") / "raw")
    generate_dataset(spark, path, 2_000, array_shape=[8])
    return path


def _job(tiny_raw, out, *extra):
    # conf/shard.yaml as shipped, on the tiny data: the shuffle stays small, 2 shards per split.
    return ["shard", "--config", "conf/shard.yaml", f"sources.raw.path={tiny_raw}", f"output.path={out}",
            "output.num_shards=2", *extra]


def _run(argv, env=None):
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, **(env or {})})
    return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.spark
def test_a_spark_job_prints_only_its_own_lines(tiny_raw, tmp_path):
    from common.config import config_fingerprint
    from pipelines.shard_config import load_shard_config
    from test_readme import FIRST_LINE, noise

    args = _job(tiny_raw, tmp_path / "ds")
    code, out, err = _run([SHARDTRAIN, *args])
    assert code == 0, err
    assert (tmp_path / "ds" / "_COMMITTED").exists()  # the job really ran Spark
    assert noise(out + err) == [], out + err
    first = err.splitlines()[0]
    assert FIRST_LINE.search(first), first
    assert first.endswith(config_fingerprint(load_shard_config(os.path.join(ROOT, "conf/shard.yaml"), args[3:])))
    # Each phase reports its rows and rate, as training reports steps/s.
    assert re.search(r"INFO shardtrain.shard: write balanced shards: 2,000 rows in [\d.]+s \([\d,]+ rows/s\)", err), err


@pytest.mark.spark
def test_verbose_gives_spark_its_logging_back(tiny_raw, tmp_path):
    code, out, err = _run([SHARDTRAIN, "-v", *_job(tiny_raw, tmp_path / "ds")])
    assert code == 0, err
    assert (tmp_path / "ds" / "_COMMITTED").exists()
    assert re.search(r"^\d\d/\d\d/\d\d \d\d:\d\d:\d\d INFO SparkContext: ", err, re.M), err[-3000:]


@pytest.mark.spark
def test_spark_submit_job_file_is_quiet_after_its_first_line(tiny_raw, tmp_path):
    """Under spark-submit the JVM is running before our Python starts: common.spark reconfigures
    its logging before the SparkContext starts, so the job's log is still only shardtrain's own
    (spark-submit relays the Python process's stderr on its stdout)."""
    from test_readme import FIRST_LINE, noise

    submit = os.path.join(os.path.dirname(sys.executable), "spark-submit")
    env = {"PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}
    code, out, err = _run([submit, "--master", "local[2]", "--conf", "spark.ui.enabled=false",
                           "shardtrain/job.py", *_job(tiny_raw, tmp_path / "ds")], env=env)
    assert code == 0, err
    assert (tmp_path / "ds" / "_COMMITTED").exists()
    assert FIRST_LINE.search(out.splitlines()[0]), out
    assert noise(out + err) == [], out + err
