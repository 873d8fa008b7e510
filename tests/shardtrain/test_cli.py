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


def shardtrain(capsys, *args):
    """The command in this process (``main(argv)``, what the console script calls): its exit status
    and stderr lines. Run from the repository root, as the conf/ paths below are relative."""
    from shardtrain.cli import main

    code = main(list(args))
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.fixture(autouse=True)
def _in_repo_without_spark(request, monkeypatch):
    """Config errors fail before anything starts: a Spark session asked for here fails the test."""
    monkeypatch.chdir(ROOT)
    if request.node.get_closest_marker("spark"):
        return  # the Spark jobs below

    def no_spark(*args, **kwargs):
        raise AssertionError("a SparkSession was requested before the config error was reported")

    from common import spark as spark_module

    monkeypatch.setattr(spark_module, "get_or_create_session", no_spark)


def _error_line(lines):
    errors = [line for line in lines if line.startswith("shardtrain: error:")]
    assert len(errors) == 1, lines  # exactly one line for the user, no traceback
    assert not any(line.startswith("Traceback") for line in lines), lines
    return errors[0]


@pytest.mark.parametrize("command", ["shard", "train", "run", "distill"])
def test_missing_config_file(capsys, command):
    code, lines = shardtrain(capsys, command, "--config", "conf/nope.yaml")
    assert code == 2
    assert _error_line(lines) == "shardtrain: error: config file not found: conf/nope.yaml"


def test_malformed_yaml_names_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sources:\n  raw: {path: x\nlabel: [\n")
    code, lines = shardtrain(capsys, "shard", "--config", str(bad))
    assert code == 2
    assert f"malformed YAML in {bad} line" in _error_line(lines)


def test_unknown_key_and_wrong_type(capsys):
    code, lines = shardtrain(capsys, "train", "--config", "conf/train.yaml", "train.batch_sise=64")
    assert code == 2
    assert _error_line(lines).endswith("unknown key 'train.batch_sise'; did you mean 'train.batch_size'?")
    code, lines = shardtrain(capsys, "train", "--config", "conf/train.yaml", "train.epochs=three")
    assert code == 2
    assert "train.epochs must be an integer, got 'three' (str)" in _error_line(lines)


def test_bad_uri_scheme_fails_before_spark_starts(capsys):
    code, lines = shardtrain(capsys, "shard", "--config", "conf/shard.yaml", "output.path=gs://bucket/ds")
    assert code == 2
    assert _error_line(lines) == ("shardtrain: error: gs://bucket/ds: unsupported URI scheme 'gs'; use a local path, "
                                  "file://, s3://, hdfs:// or dbfs:/")


def test_s3_without_credentials_fails_before_spark_starts(tmp_path, capsys, monkeypatch):
    from common import storage

    for key, value in {"AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"), "AWS_CONFIG_FILE": str(tmp_path / "none"),
                       "AWS_EC2_METADATA_DISABLED": "true", "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": ""}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(storage, "_FS_CACHE", {})  # no file system an earlier test built with credentials
    code, lines = shardtrain(capsys, "run", "--config", "conf/run.yaml", "shard.output.path=s3://bucket/ds")
    assert code == 2
    assert "s3://bucket/ds: no AWS credentials found" in _error_line(lines)


def test_train_refuses_a_missing_dataset_before_launching(tmp_path, capsys):
    code, lines = shardtrain(capsys, "train", "--config", "conf/train.yaml", f"data.path={tmp_path}/none")
    assert code == 2
    assert f"{tmp_path}/none: no such dataset" in _error_line(lines)


@pytest.mark.process
def test_exit_status_of_the_real_process():
    """The console script itself: argparse's usage error and a config error both exit 2 with one
    line on stderr (the tests above call the same main() in this process), --version exits 0."""
    proc = subprocess.run([SHARDTRAIN, "shard"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--config" in proc.stderr
    proc = subprocess.run([SHARDTRAIN, "shard", "--config", "conf/nope.yaml"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 2
    assert _error_line(proc.stderr.strip().splitlines()) == "shardtrain: error: config file not found: conf/nope.yaml"
    proc = subprocess.run([SHARDTRAIN, "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("shardtrain ")


# --- quiet by default: only shardtrain's own lines, the first naming version and config ---------
# The console script's Spark job (`shardtrain shard --config conf/shard.yaml`, exit 0, only its own
# lines, the first naming the command) is the README's own step, which test_readme runs and checks
# so (test_readme_step, FIRST_LINE and noise); the job file under spark-submit below, the same job
# and config, also checks which config the first line names and the phase's rate line.

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


@pytest.mark.process
@pytest.mark.spark
def test_verbose_gives_spark_its_logging_back(tmp_path):
    # -v is the command line's, before any command: the smallest Spark command shows it (the quiet
    # default is checked on the shard job below and in the README's steps; both sessions come from
    # common.spark).
    code, out, err = _run([SHARDTRAIN, "-v", "generate", str(tmp_path / "raw"), "--rows", "100"])
    assert code == 0, err
    assert out.startswith("wrote 100 rows (parquet)"), out
    assert any(name.endswith(".parquet") for name in os.listdir(tmp_path / "raw"))  # Spark really ran
    assert re.search(r"^\d\d/\d\d/\d\d \d\d:\d\d:\d\d INFO SparkContext: ", err, re.M), err[-3000:]


@pytest.mark.process
@pytest.mark.spark
def test_spark_submit_job_file_is_quiet_after_its_first_line(tiny_raw, tmp_path):
    """Under spark-submit the JVM is running before our Python starts: common.spark reconfigures
    its logging before the SparkContext starts, so the job's log is still only shardtrain's own
    (spark-submit relays the Python process's stderr on its stdout): the first line names the
    command, its version and the config's fingerprint, and each phase reports its rows and rate,
    as training reports steps/s."""
    from common.config import config_fingerprint
    from pipelines.shard_config import load_shard_config
    from test_readme import FIRST_LINE, noise

    submit = os.path.join(os.path.dirname(sys.executable), "spark-submit")
    env = {"PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}
    args = _job(tiny_raw, tmp_path / "ds")
    code, out, err = _run([submit, "--master", "local[2]", "--conf", "spark.ui.enabled=false", "shardtrain/job.py",
                           *args], env=env)
    assert code == 0, err
    assert (tmp_path / "ds" / "_COMMITTED").exists()  # the job really ran Spark
    first = out.splitlines()[0]
    assert FIRST_LINE.search(first), out
    assert first.endswith(config_fingerprint(load_shard_config(os.path.join(ROOT, "conf/shard.yaml"), args[3:])))
    assert noise(out + err) == [], out + err
    assert re.search(r"INFO shardtrain.shard: write balanced shards: 2,000 rows in [\d.]+s \([\d,]+ rows/s\)", out), out
