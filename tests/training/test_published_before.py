"""What a user published before training was reshaped into strategies (commit 3a22c37) still
works after it: the model loads and predicts what it predicted then, and a run interrupted then
resumes now from its checkpoint and ends with the weights the old code's uninterrupted run
published, to the bit. The files in fixtures/published_before were written by that commit
(fixtures/make_published_before.py says how)."""

import json
import os
import shutil

import numpy as np
import pytest

from tabular_data import raw_frame
from train_configs import train_config
from training import load_model, train

pytestmark = pytest.mark.stack

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "published_before")


def _weights(model_dir):
    from safetensors.torch import load_file

    return load_file(os.path.join(model_dir, "model.safetensors"))


def test_a_model_published_before_predicts_what_it_did():
    with open(os.path.join(FIXTURE, "expected.json")) as fh:
        expected = json.load(fh)
    rows = raw_frame(expected["rows"], seed=expected["rows_seed"])
    predictions = load_model(os.path.join(FIXTURE, "model")).predict(rows)
    np.testing.assert_allclose(np.asarray(predictions), np.asarray(expected["predictions"]), rtol=0, atol=1e-6)


def test_a_checkpoint_written_before_resumes_to_the_old_uninterrupted_weights(tmp_path):
    data, checkpoints = tmp_path / "dataset", tmp_path / "checkpoints"
    shutil.copytree(os.path.join(FIXTURE, "dataset"), data)
    shutil.copytree(os.path.join(FIXTURE, "checkpoints"), checkpoints)
    cfg = train_config(data, tmp_path / "model",
        f"checkpoint.path={checkpoints}", "train.epochs=2", "train.batch_size=16", "train.lr=0.01",
        "train.log_every_steps=5", "data.shuffle_buffer_rows=50", "model.hidden=[8]", "model.dropout=0.1",
        "checkpoint.every_steps=5")
    result = train(cfg)
    assert result.resumed_from and result.resumed_from.rstrip("/").endswith("step-000000010")  # it did resume
    assert result.steps_per_rank == [2 * result.steps_per_epoch] and result.steps_per_epoch > 5
    old, new = _weights(os.path.join(FIXTURE, "model")), _weights(tmp_path / "model")
    assert sorted(old) == sorted(new)
    for name in old:
        assert old[name].equal(new[name]), name
