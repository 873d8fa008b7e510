"""A training run pins the dataset it planned on: a dataset rewritten by another process while a
real training run reads it fails that run (exit 1, naming the dataset) before anything is
published. The run is held at a known step by a gated plug-in model (plugin_models.gated), so the
rewrite lands mid-run without sleeps or timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from common.dataset import MANIFEST_NAME
from flip_labels import flip
from polling import wait_for
from tabular_data import write_dataset
from train_configs import train_overrides

HERE = os.path.dirname(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
LAYOUT = {"train": [[400, 150], [300], [190]], "val": [[120], [80]]}  # 32 steps/epoch at batch 32


def train_process(tmp_path, ds: str, model: str, gate: str | None, *extra: str) -> subprocess.Popen:
    """A real ``shardtrain train`` in its own process, held at its 40th training step (epoch 2)
    until ``<gate>.go`` exists (``gate=None``: never held)."""
    config = tmp_path / "train.yaml"
    config.write_text("launch:\n  mode: in_process\n  num_proc: 1\n")
    # One torch thread: the run's ~130 tiny steps gain nothing from a second one, whose waiting
    # cost about as much CPU as the run itself on this 2-core machine.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, HERE]), "OMP_NUM_THREADS": "1"}
    env.pop("SHARDTRAIN_TEST_GATE", None)
    if gate:
        env["SHARDTRAIN_TEST_GATE"] = gate
    args = train_overrides(ds, model, "train.epochs=4", "train.batch_size=32", "data.shuffle_buffer_rows=100",
                           "model.name=plugin_models:gated", "model.kwargs={after: 40}", *extra, ranks=None)
    return subprocess.Popen([sys.executable, "-m", "shardtrain", "train", "--config", str(config), *args],
                            env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_at_gate(proc: subprocess.Popen, gate: str) -> int:
    """The training's pid once it waits at its gate (it holds its lease and locks then)."""
    wait_for(lambda: os.path.exists(gate + ".waiting"), "the training to wait at its gate", timeout=600, proc=proc)
    return int(open(gate + ".waiting").read())


def open_gate(proc: subprocess.Popen, gate: str) -> tuple[int, str]:
    open(gate + ".go", "w").close()
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err


def fingerprint(ds: str) -> str:
    return json.load(open(os.path.join(ds, MANIFEST_NAME)))["fingerprint"]


@pytest.mark.process
@pytest.mark.parametrize("reader, rewrite_args", [("arrow", []), ("petastorm", ["--fewer"])])
def test_a_dataset_rewritten_by_another_process_mid_run_fails_the_run_and_nothing_is_published(
        tmp_path, reader, rewrite_args):
    """The probe: same row counts, labels flipped, written by another process while a 4-epoch
    training is in its second epoch. Before: training went on and published (exit 0); with fewer
    rows it exited 2, as if the dataset were damaged. The petastorm reader under a same-row-count
    rewrite is the shard-overwrite test's run below (the default reader, labels flipped by a real
    shard job), so it has no launch of its own here."""
    if reader == "petastorm":
        pytest.importorskip("petastorm")  # the current profile has only the arrow reader
    ds = str(tmp_path / "ds")
    planned = write_dataset(ds, LAYOUT).manifest["fingerprint"]
    model, gate = str(tmp_path / "model"), str(tmp_path / "gate")
    proc = train_process(tmp_path, ds, model, gate, f"data.reader={reader}")
    wait_at_gate(proc, gate)

    # The rewrite comes from this process, another one than the training's (a fresh interpreter
    # for it proved nothing more, at its start-up's cost).
    rewritten = flip(ds, fewer="--fewer" in rewrite_args)
    assert fingerprint(ds) == rewritten != planned  # the dataset on disk really changed

    code, err = open_gate(proc, gate)
    assert code == 1, err[-3000:]
    assert f"dataset {ds}: it was rewritten while training read it" in err, err[-3000:]
    assert "Traceback" not in err
    assert not os.path.exists(model)  # no model, so no _COMMITTED either


# --- reader leases: a real shard job against a real training process ---------------------------

SHARD_YAML = """
sources: {{raw: {{path: {raw}, format: parquet}}}}
features: {{numeric: [x], categorical: [c]}}
label: {{column: y, task: classification, num_classes: 2}}
split: {{key: id, fractions: {{train: 0.8, val: 0.2}}}}
output: {{path: {ds}, num_shards: 2}}
quality: {{max_bad_fraction: 0.0}}
"""
FLIPPED = ["label.column=null", "label.expr=1 - y", "output.mode=overwrite"]  # same rows, labels flipped


@pytest.fixture(scope="module")
def raw_input(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("raw") / "raw"
    root.mkdir()
    ids = list(range(1200))
    pq.write_table(pa.table({"id": ids, "x": [float(i % 17) for i in ids], "c": [f"k{i % 5}" for i in ids],
                             "y": [int(i % 17 > 8) for i in ids]}), root / "part-0.parquet")
    return str(root)


def shard(tmp_path, raw: str, ds: str, *overrides: str) -> int:
    """The real `shardtrain shard` command, in this process (on the shared Spark session)."""
    from shardtrain.cli import main

    config = tmp_path / "shard.yaml"
    config.write_text(SHARD_YAML.format(raw=raw, ds=ds))
    return main(["shard", "--config", str(config), *overrides])


def data_files(ds: str) -> dict[str, tuple[int, int]]:
    """Every file of the dataset with its size and mtime_ns: what an untouched dataset keeps."""
    found = {}
    for dirpath, _, names in os.walk(ds):
        for name in names:
            st = os.stat(os.path.join(dirpath, name))
            found[os.path.relpath(os.path.join(dirpath, name), ds)] = (st.st_size, st.st_mtime_ns)
    return found


def leases(ds: str) -> list[dict]:
    from common.leases import readers_location

    where = readers_location(ds).path
    return [json.load(open(os.path.join(where, n))) for n in sorted(os.listdir(where))] if os.path.isdir(where) else []


@pytest.mark.process
def test_a_shard_overwrite_refuses_a_dataset_a_training_reads_unless_told_and_then_the_training_fails(
        spark, raw_input, tmp_path, capsys, caplog):
    """Also the petastorm reader's case of a same-row-count rewrite mid-run (where petastorm is
    installed, as on the pinned profile): the overwrite flips the labels and keeps the rows."""
    import importlib.util
    import socket

    ds, model, gate = str(tmp_path / "ds"), str(tmp_path / "model"), str(tmp_path / "gate")
    assert shard(tmp_path, raw_input, ds) == 0
    planned = fingerprint(ds)
    reader = "petastorm" if importlib.util.find_spec("petastorm") else "arrow"
    proc = train_process(tmp_path, ds, model, gate, f"data.reader={reader}")
    pid = wait_at_gate(proc, gate)
    held = leases(ds)
    assert [(r["pid"], r["host"]) for r in held] == [(pid, socket.gethostname())]  # the running training's lease
    before = data_files(ds)
    capsys.readouterr()

    assert shard(tmp_path, raw_input, ds, *FLIPPED) == 1
    err = capsys.readouterr().err
    assert f"{ds} is being read by 1 training run(s): pid {pid} on host {socket.gethostname()}, started " \
           f"{held[0]['started_at']}" in err, err
    assert "output.ignore_readers=true" in err
    assert data_files(ds) == before and fingerprint(ds) == planned  # the dataset is untouched

    assert shard(tmp_path, raw_input, ds, *FLIPPED, "output.ignore_readers=true") == 0
    assert fingerprint(ds) != planned  # really overwritten, under the running training
    assert f"overwriting it while 1 training run(s) read it (pid {pid} on host" in caplog.text

    code, err = open_gate(proc, gate)
    assert code == 1, err[-3000:]
    assert f"dataset {ds}: it was rewritten while training read it" in err, err[-3000:]
    assert "Traceback" not in err
    assert not os.path.exists(model)  # no model, so no _COMMITTED either
    assert leases(ds) == []  # the failed run released its lease


@pytest.mark.process
def test_the_lease_of_a_killed_training_is_ignored_and_removed(spark, raw_input, tmp_path, caplog):
    import signal

    ds, gate = str(tmp_path / "ds"), str(tmp_path / "gate")
    assert shard(tmp_path, raw_input, ds) == 0
    planned = fingerprint(ds)
    proc = train_process(tmp_path, ds, str(tmp_path / "model"), gate)
    pid = wait_at_gate(proc, gate)
    os.kill(pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL  # it really died, by the signal (and is reaped)
    assert [r["pid"] for r in leases(ds)] == [pid]  # its lease is still there

    assert shard(tmp_path, raw_input, ds, *FLIPPED) == 0
    assert fingerprint(ds) != planned
    assert leases(ds) == [] and f"removing the reader lease of pid {pid} on host" in caplog.text
    assert "which has exited" in caplog.text


def test_several_readers_hold_leases_at_once_and_a_silent_one_from_another_host_goes_stale(tmp_path):
    """Two leases in this process, and leases of another host (real files, records as a reader
    there writes them): its heartbeat decides, since its pid cannot be checked from here."""
    import datetime as dt

    from common.leases import STALE_S, active_readers, reader_lease, readers_location

    ds = str(tmp_path / "ds")
    os.makedirs(ds)
    with reader_lease(ds) as one, reader_lease(ds) as two:
        assert {r["token"] for r in active_readers(ds)} == {one["token"], two["token"]}
        where = readers_location(ds).path
        now = dt.datetime.now(dt.timezone.utc)
        for name, age in (("fresh", 0), ("silent", STALE_S + 60)):
            stamp = (now - dt.timedelta(seconds=age)).strftime("%Y-%m-%dT%H:%M:%SZ")
            with open(os.path.join(where, f"{name}.json"), "w") as fh:
                json.dump({"host": "another-host", "pid": 1, "started_at": stamp, "heartbeat_at": stamp,
                           "token": name}, fh)
        assert {r["token"] for r in active_readers(ds)} == {one["token"], two["token"], "fresh"}
        assert not os.path.exists(os.path.join(where, "silent.json"))  # the stale one was removed
        os.remove(os.path.join(where, "fresh.json"))
    assert active_readers(ds) == [] and not os.path.exists(readers_location(ds).path)


# --- one writer per model path, from the start of training ------------------------------------

def run_dir_files(run_dir: str) -> dict[str, tuple[int, int]]:
    return data_files(run_dir) if os.path.isdir(run_dir) else {}


@pytest.mark.process
def test_a_second_training_on_a_model_path_in_use_exits_1_naming_the_first_which_publishes_normally(tmp_path):
    """Before: the lock was taken only at publish, so both runs trained into one run directory and
    the later publish replaced the earlier. Now the first run holds the model path from its start."""
    import socket

    ds, model = str(tmp_path / "ds"), str(tmp_path / "model")
    write_dataset(ds, LAYOUT)
    first = train_process(tmp_path, ds, model, str(tmp_path / "gate1"), "checkpoint.every_steps=10")
    pid = wait_at_gate(first, str(tmp_path / "gate1"))
    held = run_dir_files(model + ".run")
    assert any(name.startswith("checkpoints/step-") for name in held), held  # it is running, checkpointing

    # The same run, never held: without the lock from the start it would resume from the first's
    # checkpoints, train and publish over the first's model (the probe: both exited 0).
    second = train_process(tmp_path, ds, model, None, "checkpoint.every_steps=10")
    _, err = second.communicate(timeout=300)
    assert first.poll() is None  # the first was running all along
    assert second.returncode == 1, err[-3000:]
    assert f"{model} is being written by pid {pid} on host {socket.gethostname()}" in err, err[-3000:]
    assert run_dir_files(model + ".run") == held  # its run directory and checkpoints untouched

    code, err = open_gate(first, str(tmp_path / "gate1"))
    assert code == 0, err[-3000:]
    marker = json.load(open(os.path.join(model, "_COMMITTED")))
    assert marker["kind"] == "shardtrain.model"
    assert json.load(open(os.path.join(model, "model.json")))["run_id"] == marker["run_id"]
    assert not os.path.exists(os.path.join(os.path.dirname(model), ".model.shardtrain-lock"))  # released
