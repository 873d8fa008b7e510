"""What a user published with earlier releases still works: the model loads and predicts what it
predicted then, and a run interrupted then resumes now from its checkpoint and ends with the
weights the old code's uninterrupted run published, to the bit. Two fixtures, each written by its
commit (fixtures/make_published_before.py says how): an MLP from before training was reshaped
into strategies (3a22c37), and an FT-Transformer over numeric, categorical and array features
from before feature kinds, tasks and model specs (71ed09f: a version-1 manifest, a format-2
model.json, which the version-1 readers read)."""

import json
import os
import shutil

import numpy as np
import pytest

from tabular_data import raw_frame
from train_configs import train_config
from training import load_model, train

pytestmark = pytest.mark.stack

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
# fixture -> the config keys its model was trained with, beside the ones both share
MODELS = {"published_before": (),
          "published_before_kinds": ("model.name=ft_transformer", "model.d_model=8", "model.layers=1", "model.heads=2")}


def _weights(model_dir):
    from safetensors.torch import load_file

    return load_file(os.path.join(model_dir, "model.safetensors"))


@pytest.mark.parametrize("fixture", list(MODELS))
def test_a_model_published_before_predicts_what_it_did(fixture):
    with open(os.path.join(FIXTURES, fixture, "expected.json")) as fh:
        expected = json.load(fh)
    shape = expected.get("array_shape")
    rows = raw_frame(expected["rows"], seed=expected["rows_seed"], array_shape=tuple(shape) if shape else None)
    predictions = load_model(os.path.join(FIXTURES, fixture, "model")).predict(rows)
    np.testing.assert_allclose(np.asarray(predictions), np.asarray(expected["predictions"]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("fixture", list(MODELS))
def test_a_checkpoint_written_before_resumes_to_the_old_uninterrupted_weights(fixture, tmp_path):
    here = os.path.join(FIXTURES, fixture)
    data, checkpoints = tmp_path / "dataset", tmp_path / "checkpoints"
    shutil.copytree(os.path.join(here, "dataset"), data)
    shutil.copytree(os.path.join(here, "checkpoints"), checkpoints)
    cfg = train_config(data, tmp_path / "model",
        f"checkpoint.path={checkpoints}", "train.epochs=2", "train.batch_size=16", "train.lr=0.01",
        "train.log_every_steps=5", "data.shuffle_buffer_rows=50", "model.hidden=[8]", "model.dropout=0.1",
        "checkpoint.every_steps=5", *MODELS[fixture])
    result = train(cfg)
    assert result.resumed_from and result.resumed_from.rstrip("/").endswith("step-000000010")  # it did resume
    assert result.steps_per_rank == [2 * result.steps_per_epoch] and result.steps_per_epoch > 5
    old, new = _weights(os.path.join(here, "model")), _weights(tmp_path / "model")
    assert sorted(old) == sorted(new)
    for name in old:
        assert old[name].equal(new[name]), name
    # The model this release published (model.json format 3, features as one list) serves as the old one did.
    shape = json.loads(open(os.path.join(here, "expected.json")).read()).get("array_shape")
    rows = raw_frame(20, seed=7, array_shape=tuple(shape) if shape else None)
    assert json.loads((tmp_path / "model" / "model.json").read_text())["format_version"] == 3
    np.testing.assert_array_equal(np.asarray(load_model(str(tmp_path / "model")).predict(rows)),
                                  np.asarray(load_model(os.path.join(here, "model")).predict(rows)))
