"""The issue's probes, re-run through the commands: outputs never replace inputs or what they do
not own, and two concurrent shard jobs on one output publish exactly one complete dataset."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from common.commit_marker import KIND_DATASET
from common.dataset import read_manifest
from common.dataset_files import verify_dataset
from common.publish import read_marker
from common.writer_lock import lock_location, output_lock
from pipelines.generate import generate_dataset
from polling import wait_for
from shardtrain.cli import main
from train_configs import train_overrides

pytestmark = pytest.mark.spark

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tree(root) -> dict[str, str]:
    """sha256 of every file under ``root`` (or of ``root`` itself, when it is a file)."""
    if os.path.isfile(root):
        return {"": hashlib.sha256(open(root, "rb").read()).hexdigest()}
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, root)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def raw(spark, tmp_path_factory):
    """A CSV source directory with an unrelated file beside the data (as in the issue's probe)."""
    root = tmp_path_factory.mktemp("probes")
    generate_dataset(spark, str(root / "raw"), 1500, seed=2, numeric=2, categorical=1, format="csv")
    (root / "raw" / "NOTES.txt").write_text("not data, but mine")
    return str(root / "raw")


def _shard_args(source: str, out: str, *extra) -> list[str]:
    return ["shard", "--config", "conf/shard.yaml", f"sources.raw.path={source}", "sources.raw.format=csv",
            "sources.raw.options.header=true", "sources.raw.options.inferSchema=true",
            f"output.path={out}", "output.num_shards=2", "features.numeric=[x0,x1]", "features.categorical=[c0]", "features.arrays={}",
            *extra]


@pytest.mark.parametrize("where", ["same", "inside"])
def test_shard_into_its_own_source_is_refused_and_the_input_survives(raw, capsys, where):
    before = _tree(raw)
    out = raw if where == "same" else os.path.join(raw, "shards")
    assert main(_shard_args(raw, out, "output.mode=overwrite")) == 2
    err = capsys.readouterr().err
    relation = "is the same path as" if where == "same" else "is inside"
    assert f"output.path {out} {relation} source 'raw'" in err
    assert _tree(raw) == before  # byte-identical, NOTES.txt included


@pytest.mark.parametrize("room, fails_at", [(0, ".ds.shardtrain-lock: taking the writer lock"),
                                             (3 * 4096, "/checked-rows/part-0")])
def test_a_shard_job_onto_a_full_disk_is_one_line_naming_the_file_and_leaves_nothing(raw, small_disk, capsys, room,
                                                                                   fails_at):
    """A real full tmpfs, with no room even for the writer lock, or room for it but not for the
    rows: one line naming the file that did not fit (an executor's write too, not its Python
    traceback), exit 1 (free space, then retry), and nothing left on the disk."""
    small_disk.fill(leave_bytes=room)
    out = small_disk.path / "ds"
    assert main(_shard_args(raw, str(out))) == 1
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("shardtrain: error:")]
    assert f"{small_disk.path}/" in line and fails_at in line, line
    assert line.endswith("failed: OSError: No space left on device") and "Traceback" not in line, line
    assert os.listdir(small_disk.path) == ["filler"]  # no output, staging directory or lock file


@pytest.fixture(scope="module")
def dataset(raw, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ds") / "ds")
    assert main(_shard_args(raw, out)) == 0
    return out


def _train_args(dataset: str, model: str, *extra) -> list[str]:
    return ["train", "--config", "conf/train.yaml",
            *train_overrides(dataset, model, "output.mode=overwrite", "train.epochs=1", *extra)]


def test_train_over_a_published_dataset_is_refused_and_the_dataset_survives(dataset, tmp_path, capsys):
    other = str(tmp_path / "other")
    shutil.copytree(dataset, other)
    before = _tree(other)
    assert main(_train_args(dataset, other, f"output.run_dir={tmp_path / 'run'}")) == 2
    err = capsys.readouterr().err
    assert f"{other} holds a shardtrain.dataset, not a shardtrain.model" in err
    assert _tree(other) == before
    # Its own input as model_path: refused as an overlap, before anything runs.
    assert main(_train_args(dataset, dataset)) == 2
    assert f"output.model_path {dataset} is the same path as the training dataset (data.path)" in capsys.readouterr().err


def test_train_over_a_regular_file_or_a_user_directory_is_refused(dataset, tmp_path, capsys):
    precious = tmp_path / "model"
    precious.write_bytes(b"not a model")
    assert main(_train_args(dataset, str(precious))) == 2
    assert f"{precious} is a regular file, not a shardtrain shardtrain.model" in capsys.readouterr().err
    assert precious.read_bytes() == b"not a model"
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "weights.bin").write_bytes(b"x")
    assert main(_train_args(dataset, str(mine))) == 2
    assert "holds 1 entry that shardtrain did not publish (weights.bin)" in capsys.readouterr().err
    assert (mine / "weights.bin").read_bytes() == b"x"


@pytest.mark.process
def test_two_concurrent_shard_jobs_publish_exactly_one_complete_dataset(raw, tmp_path, capsys):
    out = str(tmp_path / "ds")
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    env = {**os.environ, "SHARDTRAIN_TEST_BARRIER": str(barrier),
           "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "tests", "pipelines"), os.environ.get("PYTHONPATH", "")])}
    args = [sys.executable, "-m", "shardtrain", *_shard_args(raw, out, "output.mode=overwrite",
                                                            "transform=shard_barrier:hold", "spark.master=local[1]",
                                                            "spark.conf.spark.driver.memory=1g")]
    first = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # The first job holds the lock and is parked inside the job (it reached the transform).
        wait_for(lambda: any(n.startswith("reached-") for n in os.listdir(barrier)),
                 "the first job to reach its transform", timeout=600, proc=first)
        assert first.poll() is None, first.communicate()
        holder = json.loads(open(lock_location(out).path).read())
        assert holder["pid"] == first.pid
        # The second writer is this process (the first is another one), on the same output: refused at the lock.
        capsys.readouterr()
        code = main(_shard_args(raw, out, "output.mode=overwrite"))
        second = capsys.readouterr()
        assert code == 1, second.err[-2000:]
        assert f"{out} is being written by pid {first.pid} on host" in second.err
        assert "published" not in second.out
        assert not os.path.exists(out)  # the refused job wrote nothing
        (barrier / "release").write_text("go")
        stdout, stderr = first.communicate(timeout=600)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, stderr[-2000:]
    assert stdout.startswith(f"published {out}")
    # Complete and consistent: one commit, every file as its manifest says, rows accounted for.
    manifest = read_manifest(out)
    assert read_marker(out)["kind"] == KIND_DATASET
    assert read_marker(out)["input_fingerprint"] == manifest.data["input_fingerprint"]
    assert verify_dataset(manifest) == []
    accounting = manifest.data["accounting"]
    assert accounting["input_rows"] == 1500 == accounting["published_rows"] + accounting["quarantined_rows"]
    assert not os.path.exists(lock_location(out).path)
    assert sorted(os.listdir(tmp_path)) == ["barrier", "ds"]  # no staging, no lock left behind


# Runs the command as ``python -m shardtrain`` does, then says whether this process launched a JVM
# (pyspark never clears SparkContext._gateway once it has launched one, stopped session or not).
JVM_PROBE = ("import sys\nfrom shardtrain.cli import main\ncode = main(sys.argv[1:])\n"
             "from pyspark import SparkContext\nprint('jvm launched:', SparkContext._gateway is not None)\n"
             "sys.exit(code)\n")


@pytest.mark.process
def test_a_refused_second_writer_starts_no_spark(raw, tmp_path):
    """The shard command takes the output's writer lock before it starts Spark, so a second writer
    is refused (exit 1, naming the holder) without paying for a JVM, and writes nothing."""
    out = str(tmp_path / "ds")
    with output_lock(out):  # the first writer: this process
        proc = subprocess.run([sys.executable, "-c", JVM_PROBE, *_shard_args(raw, out, "output.mode=overwrite")],
                              cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"{out} is being written by pid {os.getpid()} on host" in proc.stderr
    assert "jvm launched: False" in proc.stdout, proc.stdout[-2000:]
    assert not os.path.exists(out)
