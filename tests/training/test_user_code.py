"""Your own model, loss and metrics in the managed loop (training.user_code): given to train() in
code, defined where the caller stands (here, inside the test function: cloudpickle ships such
classes and functions by value, as it does a notebook's), or carried by a package's model as its
own methods (Lightning-style). The same code both ways trains to the same weights; the metrics'
sums are reduced over the ranks, so at 2 ranks they equal one computation over the whole split;
code that raises is exit 2 before any step, with the user's own line in the message."""

import numpy as np
import pytest
import torch
from torch import nn

from common.errors import EXIT_USAGE, ConfigError
from tabular_data import write_dataset
from train_configs import train_config
from user_code_cells import notebook_code
from training import load_model, train

LAYOUT = {"train": [[300, 100], [200]], "val": [[90], [61]]}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(str(tmp_path_factory.mktemp("user-code") / "ds"), LAYOUT)


@pytest.fixture(scope="module")
def code_model(dataset, tmp_path_factory):
    """A model given to train() in code: its class exists nowhere importable."""
    out = tmp_path_factory.mktemp("code-model")
    return train(train_config(dataset, out / "model", "train.epochs=1", "model.kwargs.width=8"),
                 model=notebook_code()["model"])


def _weights(result):
    from safetensors.numpy import load_file

    return load_file(f"{result.model_uri}/model.safetensors")


def _single_process_metrics(result, dataset):
    """my_accuracy and mean_p_true over the whole val split, from the published model's predictions."""
    val = dataset.raw["val"]
    probabilities = load_model(result.model_uri, trust_code=True).predict(val)
    label = val["label"].to_numpy()
    return {"val_my_accuracy": float((probabilities.argmax(axis=1) == label).mean()),
            "val_mean_p_true": float(probabilities[np.arange(len(label)), label].mean())}


def test_code_given_to_train_trains_like_the_same_code_imported_by_name(dataset, tmp_path):
    settings = ("train.epochs=2", "train.batch_size=32", "train.lr=0.01", "model.kwargs.width=8")
    given = train(train_config(dataset, tmp_path / "given" / "model", *settings), **notebook_code())
    named = train(train_config(dataset, tmp_path / "named" / "model", "model.name=plugin_models:focal_net",
                               *settings))
    wa, wb = _weights(given), _weights(named)
    assert wa.keys() == wb.keys()
    for name in wa:
        np.testing.assert_array_equal(wa[name], wb[name], err_msg=name)
    # The focal loss trained it, not the task's cross-entropy: its val loss is the focal loss.
    assert given.final["val_loss"] == named.final["val_loss"] < given.final["train_loss"] * 2
    ce = train(train_config(dataset, tmp_path / "ce" / "model", *settings), model=notebook_code()["model"])
    assert not np.array_equal(_weights(ce)["net.body.0.weight"], wa["net.body.0.weight"])
    # The user's metrics, by name, beside the task's; at 1 rank, as one computation over the split.
    for result in (given, named):
        mine = {k: result.final[k] for k in ("val_my_accuracy", "val_mean_p_true")}
        assert mine["val_my_accuracy"] == pytest.approx(result.final["val_accuracy"], abs=1e-12)
        assert mine == pytest.approx(_single_process_metrics(result, dataset), abs=1e-6)
    import json

    record = json.load(open(f"{given.model_uri}/model.json"))["model"]
    assert record["code"]["objects"]["loss"].endswith("notebook_code.<locals>.focal")


def test_code_stored_with_a_model_runs_only_when_trusted_and_only_as_published(code_model, dataset, tmp_path, caplog):
    """The class exists nowhere importable (TorchScript cannot read its source either: no program).
    The model holds it, pickled; loading runs it only with trust_code, logging its sha256, and a
    changed byte in it is refused naming the file."""
    import hashlib
    import json
    import shutil

    from common.errors import DatasetError

    result = code_model
    files = json.load(open(f"{result.model_uri}/model.json"))["files"]
    assert "model.torchscript.pt" not in files and "model.code.pkl" in files
    with pytest.raises(ConfigError, match=r"trained from code given to train\(\) \(model .*notebook_code.<locals>.Net\), "
                                          r"which it holds in model.code.pkl .*trust_code=True"):
        load_model(result.model_uri)
    with caplog.at_level("WARNING", logger="shardtrain.train"):
        values = load_model(result.model_uri, trust_code=True).predict(dataset.raw["val"].iloc[result.reference["rows"]])
    np.testing.assert_allclose(values, np.array(result.reference["predictions"]), rtol=1e-5, atol=1e-5)
    digest = hashlib.sha256(open(f"{result.model_uri}/model.code.pkl", "rb").read()).hexdigest()
    assert f"running the code stored with the model {result.model_uri}" in caplog.text and digest in caplog.text

    copy = str(tmp_path / "copy")
    shutil.copytree(result.model_uri, copy)
    data = bytearray(open(f"{copy}/model.code.pkl", "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(f"{copy}/model.code.pkl", "wb").write(bytes(data))
    assert hashlib.sha256(bytes(data)).hexdigest() != digest  # the byte really changed
    with pytest.raises(DatasetError, match=r"model.code.pkl: does not match the sha256 recorded in model.json"):
        load_model(copy, trust_code=True)


@pytest.mark.spark
@pytest.mark.ranks
@pytest.mark.stack  # TorchDistributor's pickling of the plan, on pyspark 3.5 and 4
def test_metrics_given_in_code_are_exact_over_two_torch_ranks(uneven_torch_run, uneven_dataset):
    """The session's 2-rank TorchDistributor run (tests/training/conftest.py) is given metrics and
    finalize functions that exist only in the driver process (local functions): they reach the
    ranks by value, each rank sums its own val rows, and the reduced metrics equal one computation
    over the whole split from the published model. (Metrics do not change what trains: the run's
    weights are the ones test_torch_backend and test_torchrun hold other runs to.)"""
    result, dataset = uneven_torch_run, uneven_dataset
    assert result.world_size == 2
    expected = _single_process_metrics(result, dataset)
    assert {k: result.final[k] for k in expected} == pytest.approx(expected, abs=1e-6)
    assert result.final["val_my_accuracy"] == pytest.approx(result.final["val_accuracy"], abs=1e-12)


@pytest.mark.spark
def test_score_and_a_teacher_run_a_models_code_only_when_trusted(spark, code_model, dataset):
    """Scoring on Spark (each worker rebuilds the model from the code it holds) and a shard job's
    teacher take the model only when told to trust its code (score's model_code, teacher.model_code)."""
    from scoring.predict import predict_frame
    from shardtrain.teacher import describe_teacher

    uri, rows = code_model.model_uri, dataset.raw["val"].drop(columns=["label"])
    frame = spark.createDataFrame(rows)
    with pytest.raises(ConfigError, match="model_code: trust"):
        predict_frame(frame, uri)
    scored = predict_frame(frame, uri, trust_code=True).toPandas().sort_values("x1")
    expected = load_model(uri, trust_code=True).predict(rows.sort_values("x1"))
    np.testing.assert_allclose(np.stack(scored["probabilities"].to_numpy()), expected, rtol=0, atol=1e-6)
    with pytest.raises(ConfigError, match="trust_code=True"):
        describe_teacher(uri)
    assert describe_teacher(uri, trust_code=True)["fingerprint"] == load_model(uri, trust_code=True).fingerprint


def test_code_that_raises_is_exit_2_before_any_step_with_the_users_line(dataset, tmp_path):
    code = notebook_code()

    def loss(outputs, batch):
        return code["loss"](outputs, batch) * batch["weights"].mean()  # no such batch entry

    cfg = train_config(dataset, tmp_path / "model", "train.epochs=1", "checkpoint.every_steps=1")
    steps = []
    with pytest.raises(ConfigError) as err:
        train(cfg, model=code["model"], loss=loss, on_step=steps.append)
    message = str(err.value)
    assert err.value.exit_code == EXIT_USAGE and steps == []
    assert "raised on a probe batch before training (KeyError: 'weights')" in message, message
    assert 'batch["weights"].mean()  # no such batch entry' in message, message  # the user's own line
    assert not (tmp_path / "model.run" / "checkpoints").exists()


def test_code_is_refused_where_it_cannot_go(dataset, tmp_path):
    code = notebook_code()
    with pytest.raises(ConfigError, match="launch.backend=torchrun .* no driver to ship"):
        train(train_config(dataset, tmp_path / "m", "launch.backend=torchrun", ranks=None), model=code["model"])
    with pytest.raises(ConfigError, match="train.pipeline.stages > 1 .* set train.pipeline.stages=1"):
        train(train_config(dataset, tmp_path / "m", "train.pipeline.stages=2", "launch.num_proc=2",
                           "launch.backend=torch", ranks=None),
              loss=code["loss"])
    with pytest.raises(ConfigError, match=r"train\(loss=\.\.\.\) must be a class or function"):
        train(train_config(dataset, tmp_path / "m"), loss="focal")


KERNEL_CELLS = [
    # 1: what a notebook user writes, at the top level of cells (IPython's __main__).
    '''
import torch
from torch import nn
from training import train
from training.models import TabularMLP, mlp_arguments
from train_configs import train_config


class Net(nn.Module):
    def __init__(self, feature_spec, label_spec, width: int = 8):
        super().__init__()
        self.net = TabularMLP(**mlp_arguments(feature_spec, label_spec, [width]))

    def forward(self, batch):
        return self.net(batch)


def focal(outputs, batch, gamma: float = 2.0):
    logp = torch.log_softmax(outputs.float(), dim=-1).gather(1, batch["label"].long().unsqueeze(1)).squeeze(1)
    return (-((1 - logp.exp()) ** gamma) * logp).mean()
''',
    # 2: train with them, then a loss with a bug, refused before any step with the cell's own line.
    '''
result = train(train_config(DATASET, OUT + "/kernel/model", *SETTINGS), model=Net, loss=focal)
print("MODEL", result.model_uri)


def buggy(outputs, batch):
    return focal(outputs, batch) * batch["weights"].mean()  # the cell's own line


try:
    train(train_config(DATASET, OUT + "/buggy/model", *SETTINGS), model=Net, loss=buggy)
except Exception as exc:
    print("REFUSED", type(exc).__name__, exc.exit_code, str(exc).replace("\\n", " | "))
''',
]


def test_a_model_and_loss_defined_in_a_real_ipython_kernel_train_like_the_same_code_imported(dataset, tmp_path):
    """A real IPython kernel (jupyter_client, as a notebook front end drives one): its cells define
    the model and loss at the top level (IPython's __main__), train() ships them by value, and the
    weights equal those of the same code imported by name (plugin_models.FocalNet, whose loss is
    its own method). A bug in a cell's loss is exit 2 before any step, naming the cell's line."""
    import json
    import os
    import sys

    from jupyter_client import KernelManager
    from jupyter_client.kernelspec import KernelSpecManager

    specs = tmp_path / "kernels" / "shardtrain-test"
    specs.mkdir(parents=True)
    (specs / "kernel.json").write_text(json.dumps({"argv": [sys.executable, "-m", "ipykernel_launcher", "-f",
                                                           "{connection_file}"],
                                                  "display_name": "shardtrain tests", "language": "python"}))
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))  # first: tests/training would shadow the training package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, here, os.path.dirname(here),
                                                        os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    kernel = KernelManager(kernel_name="shardtrain-test", kernel_spec_manager=KernelSpecManager(
        kernel_dirs=[str(tmp_path / "kernels")]))
    kernel.start_kernel(cwd=str(tmp_path), env=env)
    client = kernel.client()
    settings = ["train.epochs=1", "train.batch_size=32", "train.lr=0.01", "model.kwargs.width=8"]
    printed = []

    def output(message):
        if message["msg_type"] == "stream":
            printed.append(message["content"]["text"])
        elif message["msg_type"] == "error":
            printed.append("\n".join(message["content"]["traceback"]))
    try:
        client.start_channels()
        client.wait_for_ready(timeout=120)
        prelude = f"DATASET, OUT, SETTINGS = {dataset.uri!r}, {str(tmp_path)!r}, {settings!r}"
        for cell in [prelude, *KERNEL_CELLS]:
            reply = client.execute_interactive(cell, timeout=300, output_hook=output)
            assert reply["content"]["status"] == "ok", "".join(printed)
    finally:
        client.stop_channels()
        kernel.shutdown_kernel(now=True)
    said = "".join(printed)
    model_uri = next(line.split(" ", 1)[1] for line in said.splitlines() if line.startswith("MODEL "))
    named = train(train_config(dataset, tmp_path / "named" / "model", "model.name=plugin_models:focal_net",
                               *settings))
    from safetensors.numpy import load_file

    mine, theirs = load_file(f"{model_uri}/model.safetensors"), load_file(f"{named.model_uri}/model.safetensors")
    assert mine.keys() == theirs.keys()
    for name in mine:
        np.testing.assert_array_equal(mine[name], theirs[name], err_msg=name)
    refused = next(line for line in said.splitlines() if line.startswith("REFUSED "))
    assert refused.startswith("REFUSED ConfigError 2 "), refused
    assert "raised on a probe batch before training (KeyError: 'weights')" in refused, refused
    assert "focal(outputs, batch) * batch[\"weights\"].mean()  # the cell's own line" in refused, refused
