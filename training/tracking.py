"""MLflow tracking of a finished training run (``tracking.mlflow``), by rank 0 once the model is
published: one MLflow run with the resolved config as parameters (dotted keys), every epoch's
metrics at its optimizer step, the dataset fingerprint as a tag, the model directory and the run
report as artifacts.

Tracking is a convenience, so it never fails training: without mlflow, with an unreachable
server or any error from MLflow, rank 0 logs one warning with the reason and the run goes on.
Nor can it hold training up: all of it runs on a daemon thread that rank 0 waits for at most
``tracking.mlflow.timeout_s`` (a server that accepts connections and never answers held a run for
20 minutes of MLflow's own retries); past that it warns and goes on, abandoning the thread.

It uses an ``MlflowClient`` for the configured URI and never ``mlflow.set_tracking_uri``: a
notebook's own MLflow setup is left as it was. Without ``tracking_uri`` the client takes MLflow's
default (``MLFLOW_TRACKING_URI``; on Databricks, the workspace's tracking server).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
import time
from typing import Iterator
from urllib.parse import urlparse

from common import __version__
from common.config import to_dict
from common.errors import StorageIOError, first_line
from common.model_registry import check_reachable
from common.storage import resolve
from training.config import MlflowConfig
from training.run_record import epoch_rates

log = logging.getLogger("shardtrain.train")

MAX_PARAMS_PER_BATCH = 100  # MLflow's limits for one log_batch
MAX_METRICS_PER_BATCH = 1000
MAX_PARAM_LENGTH = 6000  # MLflow's limit for a param value
# MLflow's per-request settings, read from the environment at each request; while tracking runs
# they are set (unless the user set them) so that one request cannot outlast the whole deadline.
_REQUEST_TIMEOUT_ENV = "MLFLOW_HTTP_REQUEST_TIMEOUT"
_MAX_RETRIES_ENV = "MLFLOW_HTTP_REQUEST_MAX_RETRIES"


class TrackingUnavailable(Exception):
    """MLflow cannot be used for this run (not installed, server unreachable); the message says why."""


def track_run_or_warn(plan, history: list[dict], report_uri: str | None) -> str | None:
    """Track the run as ``plan.config.tracking.mlflow`` says; the MLflow run id, or None after one warning."""
    cfg = plan.config.tracking.mlflow
    try:
        run_id = within_deadline(lambda: track_run(cfg, plan, history, report_uri), cfg)
    except Exception as exc:  # noqa: BLE001 - tracking must never fail training (module docstring)
        log.warning("MLflow tracking skipped, the training run is unaffected: %s", _reason(exc))
        return None
    log.info("MLflow run %s recorded (tracking URI %s)", run_id, cfg.tracking_uri or "MLflow's default")
    return run_id


def track_run(cfg: MlflowConfig, plan, history: list[dict], report_uri: str | None) -> str:
    client = _client(cfg)
    run = client.create_run(_experiment_id(client, cfg.experiment), run_name=cfg.run_name,
                            tags={**cfg.tags, "dataset_fingerprint": plan.fingerprint, "dataset_uri": plan.dataset_uri,
                                  "model_uri": plan.model_path, "shardtrain_version": __version__})
    run_id = run.info.run_id
    try:
        _log_params(client, run_id, flatten(to_dict(plan.config)))
        _log_metrics(client, run_id, history, plan.world_size * plan.config.train.batch_size
                     * plan.config.train.grad_accum)
        with local_copy(plan.model_path) as model_dir:
            client.log_artifacts(run_id, model_dir, artifact_path="model")
            _log_pyfunc_model(cfg, plan, run_id, model_dir)
        if report_uri:
            with local_copy(report_uri) as report:
                client.log_artifact(run_id, report)
    except BaseException:
        client.set_terminated(run_id, status="FAILED")
        raise
    client.set_terminated(run_id, status="FINISHED")
    return run_id


def _log_pyfunc_model(cfg: MlflowConfig, plan, run_id: str, model_dir: str) -> None:
    """The published model as the run's MLflow pyfunc model, registered when
    tracking.mlflow.registered_model is set (training.mlflow_model)."""
    from training.mlflow_model import log_and_register

    with open(os.path.join(model_dir, "model.json"), encoding="utf-8") as fh:
        meta = json.load(fh)
    data = plan.config.data
    outcome = log_and_register(cfg, run_id, model_dir, meta, plan.dataset_uri,
                               [s for s in (data.val_split, data.train_split) if s])
    log.info("MLflow model %s logged%s", outcome["model_uri"],
             f"; registered as {cfg.registered_model} version {outcome['version']}" if outcome["version"] else "")


def within_deadline(call, cfg: MlflowConfig):
    """``call()`` on a daemon thread, waited for at most ``cfg.timeout_s``: its result, its
    exception, or TrackingUnavailable naming the URI and the deadline. A thread cannot be stopped,
    only abandoned: it ends with its process, or sooner with MLflow's request timeout set here."""
    outcome: dict = {}

    def target():
        try:
            outcome["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread as is
            outcome["error"] = exc

    with _request_limits(cfg.timeout_s):
        thread = threading.Thread(target=target, name="shardtrain-mlflow", daemon=True)
        thread.start()
        thread.join(cfg.timeout_s)
    if thread.is_alive():
        raise TrackingUnavailable(
            f"MLflow at {cfg.tracking_uri or 'the default tracking URI'} did not finish within "
            f"tracking.mlflow.timeout_s={cfg.timeout_s:g} s (a server that accepts connections but does not "
            "answer?); the MLflow run, if one was created, stays unfinished")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@contextlib.contextmanager
def _request_limits(timeout_s: float) -> Iterator[None]:
    """One MLflow HTTP request lasts at most the deadline, retried at most twice (MLflow's default:
    a 120 s timeout and 7 retries with backoff). Variables the user set are left as they are."""
    added = {name: value for name, value in ((_REQUEST_TIMEOUT_ENV, str(max(1, int(timeout_s)))),
                                             (_MAX_RETRIES_ENV, "2")) if name not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name, value in added.items():
            if os.environ.get(name) == value:
                del os.environ[name]


def flatten(data: dict, prefix: str = "") -> dict[str, str]:
    """{"train": {"lr": 0.1}} -> {"train.lr": "0.1"}; lists and empty mappings as JSON, null as "null"."""
    flat = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
            flat[name] = text[:MAX_PARAM_LENGTH]
    return flat


@contextlib.contextmanager
def local_copy(uri: str) -> Iterator[str]:
    """A local path holding ``uri`` (a file or a directory): the path itself for local storage, a
    temporary copy otherwise (MLflow uploads artifacts from local paths)."""
    loc = resolve(uri)
    if loc.scheme == "file":
        yield loc.path
        return
    with tempfile.TemporaryDirectory(prefix="shardtrain-mlflow-") as tmp:
        target = os.path.join(tmp, loc.path.rstrip("/").rsplit("/", 1)[-1])
        loc.fs.get(loc.path, target, recursive=loc.fs.isdir(loc.path))
        yield target


def local_store_path(tracking_uri: str | None) -> str | None:
    """The local file or directory an MLflow tracking URI keeps its runs in (a SQLite database
    file, a file store), or None for a server, Databricks or MLflow's default. Relative paths are
    relative to the working directory, as MLflow takes them."""
    if not tracking_uri:
        return None
    uri = tracking_uri.strip()
    if uri.startswith("sqlite://"):
        # SQLAlchemy's form: sqlite:///relative.db, sqlite:////absolute.db; sqlite:// is in memory.
        path = uri[len("sqlite://"):].split("?", 1)[0]
        return path[1:] if path.startswith("/") and len(path) > 1 else None
    parsed = urlparse(uri)
    if parsed.scheme == "file":
        return parsed.path or None
    if parsed.scheme or uri in ("databricks", "databricks-uc", "uc"):
        return None  # a server (http, https, databricks://profile, ...)
    return uri  # a bare path: MLflow's file store


def _client(cfg: MlflowConfig):
    try:
        from mlflow.tracking import MlflowClient
    except ImportError as exc:
        raise TrackingUnavailable(f"mlflow is not installed ({exc}); pip install 'shardtrain[mlflow]'") from None
    client = MlflowClient(tracking_uri=cfg.tracking_uri)
    _check_reachable(client.tracking_uri)
    return client


def _check_reachable(tracking_uri: str) -> None:
    """Fail in seconds on a server nobody answers at: MLflow itself would retry for minutes."""
    try:
        check_reachable(tracking_uri, "the tracking server")
    except StorageIOError as exc:
        raise TrackingUnavailable(str(exc)) from None


def _experiment_id(client, name: str | None) -> str:
    if name is None:
        # MLflow's own choice: MLFLOW_EXPERIMENT_ID / _NAME, a Databricks notebook's experiment, else Default.
        from mlflow.tracking.fluent import _get_experiment_id

        return _get_experiment_id()
    experiment = client.get_experiment_by_name(name)
    return experiment.experiment_id if experiment else client.create_experiment(name)


def _log_params(client, run_id: str, params: dict[str, str]) -> None:
    from mlflow.entities import Param

    items = [Param(key, value) for key, value in sorted(params.items())]
    for start in range(0, len(items), MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, params=items[start:start + MAX_PARAMS_PER_BATCH])


def _log_metrics(client, run_id: str, history: list[dict], samples_per_step: int) -> None:
    """Each epoch's numeric values and rates, at the optimizer step the epoch ended on."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    metrics = []
    for record in history:
        values = {**record, **epoch_rates(record, samples_per_step)}
        metrics += [Metric(key, float(value), now, int(record["step"])) for key, value in sorted(values.items())
                    if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)]
    for start in range(0, len(metrics), MAX_METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=metrics[start:start + MAX_METRICS_PER_BATCH])


def _reason(exc: BaseException) -> str:
    if isinstance(exc, TrackingUnavailable):
        return str(exc)
    return f"{type(exc).__name__}: {first_line(exc)}"


__all__ = ["TrackingUnavailable", "flatten", "local_copy", "local_store_path", "track_run", "track_run_or_warn", "within_deadline"]
