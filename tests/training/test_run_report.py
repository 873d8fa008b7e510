"""The run report: written by rank 0 at the end of training, the same again from
``shardtrain report RUN_DIR``, a clear exit 2 for a directory that is no finished run, and a report
that cannot be written only warns. One short in-process run serves the module; the 2-rank
Horovod run of test_horovod_spark.py and the restarted run of test_failures.py check their
reports too (run_report_checks.py)."""

import json
import logging
import os
import subprocess
import sys

import pytest

from run_report_checks import assert_run_report, embedded_images
from tabular_data import write_dataset
from train_configs import train_config
from training import train

SHARDTRAIN = os.path.join(os.path.dirname(sys.executable), "shardtrain")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(str(tmp_path_factory.mktemp("report") / "ds"), {"train": [[300], [340]], "val": [[100]]})


def _cfg(ds, out, *extra):
    return train_config(ds, f"{out}/model", "train.epochs=2", "train.batch_size=32", "train.log_every_steps=4",
                        "model.hidden=[8]", *extra)


@pytest.fixture(scope="module")
def finished(dataset, tmp_path_factory):
    return train(_cfg(dataset, tmp_path_factory.mktemp("run")))


def _cli(*args):
    return subprocess.run([SHARDTRAIN, *args], capture_output=True, text=True, timeout=300)


def test_training_writes_the_report_and_the_command_rebuilds_it_identically(finished, dataset):
    text = assert_run_report(finished.run_dir, dataset.manifest["fingerprint"], 1, finished.metrics)
    steps = [json.loads(line) for line in open(os.path.join(finished.run_dir, "steps.jsonl"))]
    assert [s["step"] for s in steps] == list(range(4, 2 * finished.steps_per_epoch + 1, 4))
    assert "Training loss per logged step" in text and len(embedded_images(text)) == 5  # 2 per epoch, 3 per step
    assert "train:" in text and "log_every_steps: 4" in text  # the resolved config

    os.rename(os.path.join(finished.run_dir, "report.html"), os.path.join(finished.run_dir, "at-training.html"))
    proc = _cli("report", finished.run_dir)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"wrote {finished.run_dir}/report.html"
    rebuilt = open(os.path.join(finished.run_dir, "report.html"), encoding="utf-8").read()
    assert rebuilt == text  # nothing in it comes from the training process: only the run directory's files


def test_a_directory_without_metrics_or_no_directory_exits_2_naming_the_path(finished, tmp_path, capsys):
    from shardtrain.cli import main  # in this process: the rebuild above is the real command's

    not_a_run = tmp_path / "not-a-run"
    not_a_run.mkdir()
    (not_a_run / "config.yaml").write_text("train: {}\n")
    for path, why in ((not_a_run, "it has no metrics.jsonl"), (tmp_path / "missing", "no such training run directory")):
        code = main(["report", str(path)])
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1, lines
        assert lines[0].startswith(f"shardtrain: error: {path}: ") and why in lines[0]
        assert not os.path.exists(path / "report.html")


def test_a_report_that_cannot_be_written_warns_and_the_model_is_published(dataset, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="shardtrain")
    blocker = tmp_path / "model.run" / "report.html"
    blocker.mkdir(parents=True)  # a directory where the report file must go: writing it fails
    result = train(_cfg(dataset, tmp_path, "train.epochs=1"))
    assert os.path.isdir(blocker) and not os.listdir(blocker)  # the write really failed
    warnings = [r.getMessage() for r in caplog.records if "run report was not written" in r.getMessage()]
    assert len(warnings) == 1 and str(blocker) in warnings[0]
    assert os.path.exists(os.path.join(result.model_uri, "_COMMITTED")) and len(result.metrics) == 1


@pytest.mark.parametrize("damage, why", [
    (lambda lines: [lines[0], lines[1][:-1] + b' "note": "caf\xe9"}'], "line 2 is not UTF-8 text (byte 0xe9)"),
    (lambda lines: [lines[0], json.dumps({k: v for k, v in json.loads(lines[1]).items() if k != "epoch"}).encode()],
     "line 2 has no number 'epoch'"),
    (lambda lines: [b"[1, 2]", lines[1]], "line 1 is not a JSON object"),
])
def test_a_damaged_metrics_file_exits_2_naming_the_file_and_line(finished, tmp_path, capsys, damage, why):
    import shutil

    from shardtrain.cli import main

    run_dir = str(tmp_path / "run")
    shutil.copytree(finished.run_dir, run_dir)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    lines = open(metrics, "rb").read().splitlines()
    assert len(lines) == 2 and all(b'"epoch"' in line for line in lines)
    open(metrics, "wb").write(b"\n".join(damage(lines)) + b"\n")
    assert open(metrics, "rb").read().splitlines() != lines  # the file really changed
    os.remove(os.path.join(run_dir, "report.html"))
    assert main(["report", run_dir]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"shardtrain: error: {metrics} {why}"), err
    assert not os.path.exists(os.path.join(run_dir, "report.html"))
