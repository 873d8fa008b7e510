"""The `shardtrain` command as a scheduler sees it: bad input fails before any work with one line
naming the file, key or URI, and exit status 2 (usage/config), distinct from 1 (runtime)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SHARDTRAIN = os.path.join(os.path.dirname(sys.executable), "shardtrain")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def shardtrain(*args, env=None):
    proc = subprocess.run([SHARDTRAIN, *args], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, **(env or {})})
    return proc.returncode, proc.stderr.strip().splitlines()


def _error_line(lines):
    errors = [line for line in lines if line.startswith("shardtrain: error:")]
    assert len(errors) == 1, lines  # exactly one line for the user, no traceback
    assert not any(line.startswith("Traceback") for line in lines), lines
    return errors[0]


@pytest.mark.parametrize("command", ["shard", "train", "run"])
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
