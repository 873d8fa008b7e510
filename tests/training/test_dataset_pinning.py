"""A training run pins the dataset it planned on: a dataset rewritten by another process while a
real training run reads it fails that run (exit 1, naming the dataset) before anything is
published. The run is held at a known step by a gated plug-in model (plugin_models.gated), so the
rewrite lands mid-run without sleeps or timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from common.dataset import MANIFEST_NAME
from tabular_data import write_dataset

HERE = os.path.dirname(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))
LAYOUT = {"train": [[400, 150], [300], [190]], "val": [[120], [80]]}  # 32 steps/epoch at batch 32


def train_process(tmp_path, ds: str, model: str, gate: str, *extra: str) -> subprocess.Popen:
    """A real ``shardtrain train`` in its own process, held at its 40th training step (epoch 2)
    until ``<gate>.go`` exists."""
    config = tmp_path / "train.yaml"
    config.write_text("launch:\n  mode: in_process\n  num_proc: 1\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, HERE])}
    args = [f"data.path={ds}", f"output.model_path={model}", "train.epochs=4", "train.batch_size=32",
            "data.shuffle_buffer_rows=100", "model.name=plugin_models:gated",
            f"model.kwargs={{gate: '{gate}', after: 40}}", *extra]
    return subprocess.Popen([sys.executable, "-m", "shardtrain", "train", "--config", str(config), *args],
                            env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_at_gate(proc: subprocess.Popen, gate: str) -> int:
    """The training's pid once it waits at its gate (it holds its lease and locks then)."""
    while not os.path.exists(gate + ".waiting"):
        if proc.poll() is not None:
            raise AssertionError(f"training ended (exit {proc.returncode}) before its gate: {proc.stderr.read()[-3000:]}")
        time.sleep(0.05)
    return int(open(gate + ".waiting").read())


def open_gate(proc: subprocess.Popen, gate: str) -> tuple[int, str]:
    open(gate + ".go", "w").close()
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err


def fingerprint(ds: str) -> str:
    return json.load(open(os.path.join(ds, MANIFEST_NAME)))["fingerprint"]


@pytest.mark.parametrize("reader", ["arrow", "petastorm"])
def test_a_dataset_rewritten_by_another_process_mid_run_fails_the_run_and_nothing_is_published(tmp_path, reader):
    """The probe: same row counts, labels flipped, written by another process while a 4-epoch
    training is in its second epoch. Before: training went on and published (exit 0)."""
    ds = str(tmp_path / "ds")
    planned = write_dataset(ds, LAYOUT).manifest["fingerprint"]
    model, gate = str(tmp_path / "model"), str(tmp_path / "gate")
    proc = train_process(tmp_path, ds, model, gate, f"data.reader={reader}")
    wait_at_gate(proc, gate)

    rewrite = subprocess.run([sys.executable, os.path.join(HERE, "flip_labels.py"), ds], capture_output=True,
                             text=True, env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert rewrite.returncode == 0, rewrite.stderr
    assert fingerprint(ds) == rewrite.stdout.strip() != planned  # the dataset on disk really changed

    code, err = open_gate(proc, gate)
    assert code == 1, err[-3000:]
    assert f"dataset {ds}: it was rewritten while training read it" in err, err[-3000:]
    assert "Traceback" not in err
    assert not os.path.exists(model)  # no model, so no _COMMITTED either
