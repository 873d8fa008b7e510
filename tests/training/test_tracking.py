"""MLflow tracking (tracking.mlflow) against a real SQLite tracking store in tmp_path, read back
with MlflowClient: parameters, per-epoch metrics at their steps, the fingerprint tag, the model and
report.html as artifacts. A tracking server nobody answers at, or no mlflow at all, only warns:
`shardtrain train` still exits 0 and publishes the model. In-process runs: tracking is rank 0's
alone, the same code on every backend."""

import json
import logging
import os
import socket
import sys
import threading

import pytest

from common.errors import ConfigError
from spark_cluster import refused_port
from tabular_data import write_dataset
from train_configs import train_overrides
from training import load_train_config, train

pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset(str(tmp_path_factory.mktemp("tracking") / "ds"), {"train": [[300], [340]], "val": [[100]]})


def _overrides(ds, out, *extra):
    return train_overrides(ds, f"{out}/model", "train.epochs=3", "train.batch_size=32", "model.hidden=[8]", *extra)


def test_a_finished_run_is_in_mlflow_with_params_metrics_tag_and_artifacts(dataset, tmp_path, monkeypatch,
                                                                          mlflow_store):
    monkeypatch.chdir(tmp_path)  # a new experiment's artifacts go to ./mlruns, MLflow's default
    uri = mlflow_store(tmp_path)  # sqlite:///{tmp_path}/mlflow.db
    result = train(load_train_config(None, _overrides(
        dataset, tmp_path, f"tracking.mlflow.tracking_uri={uri}", "tracking.mlflow.experiment=shardtrain-test",
        "tracking.mlflow.run_name=nightly")))

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("shardtrain-test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "nightly" and run.info.status == "FINISHED"
    params = run.data.params
    assert params["train.epochs"] == "3" and params["model.hidden"] == "[8]" and params["data.path"] == dataset.uri
    assert params["tracking.mlflow.experiment"] == "shardtrain-test" and params["launch.env"] == "{}"
    assert run.data.tags["dataset_fingerprint"] == dataset.manifest["fingerprint"]
    run_id = run.info.run_id
    assert [e["step"] for e in result.metrics] == [20, 40, 60]
    expected = {key: [e[key] for e in result.metrics] for key in ("train_loss", "val_loss", "val_accuracy", "samples")}
    expected["samples_per_s"] = [e["samples"] / e["seconds"] for e in result.metrics]
    for key, values in expected.items():  # one value per epoch, at the optimizer step the epoch ended on
        history = sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)
        assert [m.step for m in history] == [20, 40, 60], key
        assert [m.value for m in history] == pytest.approx(values), key

    top = {a.path for a in client.list_artifacts(run_id)}
    assert top == {"model", "report.html"}
    model_files = {a.path for a in client.list_artifacts(run_id, "model")}
    assert {"model/model.json", "model/model.safetensors", "model/_COMMITTED"} <= model_files
    local = client.download_artifacts(run_id, "model/model.json", str(tmp_path / "back"))
    assert json.load(open(local)) == json.load(open(os.path.join(result.model_uri, "model.json")))
    report = client.download_artifacts(run_id, "report.html", str(tmp_path / "back"))
    assert open(report).read() == open(os.path.join(result.run_dir, "report.html")).read()


def test_tracking_that_cannot_work_warns_once_and_training_exits_0_with_the_model(dataset, tmp_path, caplog,
                                                                                   monkeypatch):
    """`shardtrain train` (main(argv), in this process) against a server nobody listens at."""
    from shardtrain.cli import main

    port = refused_port()
    overrides = _overrides(dataset, tmp_path, "train.epochs=1", f"tracking.mlflow.tracking_uri=http://127.0.0.1:{port}")
    (tmp_path / "train.yaml").write_text("train:\n  log_every_steps: 5\n")
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert main(["train", "--config", "train.yaml", *overrides]) == 0
    warnings = [r for r in caplog.records if "MLflow tracking skipped" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert f"127.0.0.1:{port}" in warnings[0].getMessage() and warnings[0].levelname == "WARNING"
    assert os.path.exists(tmp_path / "model" / "_COMMITTED") and os.path.exists(tmp_path / "model.run" / "report.html")
    assert not os.path.exists(tmp_path / "mlruns")  # nothing was tracked anywhere else instead


def test_without_mlflow_installed_tracking_warns_once_and_training_exits_0_with_the_model(dataset, tmp_path, caplog,
                                                                                       monkeypatch):
    """`shardtrain train` (main(argv), in this process) where importing mlflow fails as it does where it
    is absent: mlflow and every submodule this process has loaded leave sys.modules for the test, and a
    None entry for mlflow makes any ``import mlflow...`` raise ImportError (put back after the test)."""
    from shardtrain.cli import main
    from training.config import installed

    for name in [n for n in sys.modules if n == "mlflow" or n.startswith("mlflow.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ImportError):
        from mlflow.tracking import MlflowClient as _  # noqa: F401 - what training's import now meets
    assert not installed("mlflow")
    overrides = _overrides(dataset, tmp_path, "train.epochs=1",
                           f"tracking.mlflow.tracking_uri=http://127.0.0.1:{refused_port()}")
    (tmp_path / "train.yaml").write_text("train:\n  log_every_steps: 5\n")
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert main(["train", "--config", "train.yaml", *overrides]) == 0
    warnings = [r for r in caplog.records if "MLflow tracking skipped" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert "mlflow is not installed" in warnings[0].getMessage() and warnings[0].levelname == "WARNING"
    assert os.path.exists(tmp_path / "model" / "_COMMITTED") and os.path.exists(tmp_path / "model.run" / "report.html")
    assert not os.path.exists(tmp_path / "mlruns")  # nothing was tracked anywhere else instead


class SilentServer:
    """A loopback TCP server that accepts every connection, reads what is sent, and never answers."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received = b""
        self.held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            self.held.append(conn)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn):
        try:
            while chunk := conn.recv(4096):
                self.received += chunk
        except OSError:
            pass

    def close(self):
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.mark.timeout(300)  # the guard: before the deadline, a silent server held training for 20 minutes
def test_a_server_that_never_answers_costs_at_most_the_deadline_with_one_warning(dataset, tmp_path, caplog):
    server = SilentServer()
    uri = f"http://127.0.0.1:{server.port}"
    try:
        with caplog.at_level(logging.WARNING, logger="shardtrain.train"):
            result = train(load_train_config(None, _overrides(
                dataset, tmp_path, "train.epochs=1", f"tracking.mlflow.tracking_uri={uri}",
                "tracking.mlflow.experiment=silent", "tracking.mlflow.timeout_s=3")))
        assert b"POST " in server.received or b"GET " in server.received  # MLflow really sent it a request
    finally:
        server.close()
    assert os.path.exists(os.path.join(result.model_uri, "_COMMITTED"))  # the run returned, model published
    warnings = [r.getMessage() for r in caplog.records if "MLflow tracking skipped" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert uri in warnings[0] and "tracking.mlflow.timeout_s=3 s" in warnings[0]
    assert "MLFLOW_HTTP_REQUEST_TIMEOUT" not in os.environ  # the per-request limits were only set while tracking


def test_tracking_keys_are_typed_and_checked_naming_the_key():
    base = ["data.path=/data/ds"]
    assert load_train_config(None, base).tracking.mlflow is None  # no tracking unless asked for
    cfg = load_train_config(None, [*base, "tracking.mlflow={}"])
    assert (cfg.tracking.mlflow.tracking_uri, cfg.tracking.mlflow.experiment, cfg.tracking.mlflow.run_name) == \
        (None, None, None)  # MLflow's own defaults: nothing is set
    with pytest.raises(ConfigError, match=r"tracking\.mlflow\.experiment must not be empty"):
        load_train_config(None, [*base, "tracking.mlflow.experiment=' '"])
    assert cfg.tracking.mlflow.timeout_s == 60
    with pytest.raises(ConfigError, match=r"tracking\.mlflow\.timeout_s must be > 0 seconds"):
        load_train_config(None, [*base, "tracking.mlflow.timeout_s=0"])
    with pytest.raises(ConfigError, match=r"did you mean 'tracking\.mlflow\.tracking_uri'"):
        load_train_config(None, [*base, "tracking.mlflow.tracking_url=http://x"])


@pytest.mark.parametrize("store", ["sqlite:///{model}/mlflow.db", "file://{model}/mlruns", "{model}/mlruns",
                                   "sqlite:///{model}"])
def test_a_tracking_store_inside_the_model_output_is_refused_naming_both_keys(dataset, tmp_path, store):
    """A publish replaces output.model_path whole: the next overwrite would delete the runs kept there."""
    model = tmp_path / "model"
    uri = store.format(model=model)
    with pytest.raises(ConfigError, match=r"^tracking\.mlflow\.tracking_uri .* output\.model_path"):
        train(load_train_config(None, _overrides(dataset, tmp_path, f"tracking.mlflow.tracking_uri={uri}")))
    assert not os.path.exists(model) and not os.path.exists(f"{model}.run")  # refused before anything ran


def test_local_store_paths_of_tracking_uris():
    from training.tracking import local_store_path

    assert local_store_path("sqlite:////abs/mlflow.db") == "/abs/mlflow.db"
    assert local_store_path("sqlite:///rel/mlflow.db?mode=ro") == "rel/mlflow.db"  # relative to the working directory
    assert local_store_path("sqlite://") is None  # in memory
    assert local_store_path("file:///abs/mlruns") == "/abs/mlruns" and local_store_path("./mlruns") == "./mlruns"
    for remote in ("http://mlflow:5000", "https://x/y", "databricks", "databricks://profile", None):
        assert local_store_path(remote) is None
