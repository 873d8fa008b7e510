"""Models in an MLflow model registry, named by ``models:/`` URIs, read as published models.

``models:/NAME/VERSION`` (a fixed version) and ``models:/NAME@ALIAS`` (whatever version the alias
points at now) are accepted wherever a model URI is taken (``load_model``, ``score.model``,
``teacher.model``, ``predict_frame``). NAME is a workspace registry name or, with a Unity
Catalog registry, ``catalog.schema.name``. Which registry: MLflow's own default
(``MLFLOW_REGISTRY_URI``, else the tracking URI: ``MLFLOW_TRACKING_URI``; on Databricks the
workspace's), unless the caller names one.

A registered shardtrain model is an MLflow pyfunc model whose artifact ``ARTIFACT_KEY`` is the
published model directory itself (``training.mlflow_model`` logs it): ``model.safetensors``,
``model.torchscript.pt``, ``model.json`` and the ``_COMMITTED`` marker. So a ``models:/`` URI is
resolved to one version through MLflow, and from there on that directory is read and verified
(every file against its sha256) exactly as a model in storage is
(``common.model_artifact.read_model``): nothing of MLflow's is trusted for the bytes. Where the
version's artifacts lie on a file system (an artifact store on a local or shared path, MLflow's
default), the directory is read where it lies (``RegistryModel.location``): a score job's executors
then load the version the driver resolved from that path, with no MLflow import, registry lookup or
download of their own. Any other artifact store is downloaded through MLflow.

Errors name the URI: a malformed one or a name, version or alias the registry does not have is
exit 2 (``DatasetError``); a registry that cannot be reached is exit 1 (``StorageIOError``:
retrying may help), found in seconds by a connection attempt rather than MLflow's minutes of
retries. This module imports mlflow only when a ``models:/`` URI is used, and nothing of training
or of common.storage and common.output_guard (which ask it about ``models:/`` URIs).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import tempfile
from dataclasses import dataclass
from typing import Iterator
from urllib.parse import urlparse

from common.errors import DatasetError, StorageError, StorageIOError, first_line

ARTIFACT_KEY = "shardtrain_model"  # the pyfunc artifact holding the published model directory
CONNECT_TIMEOUT_S = 10
_VERSION = re.compile(r"^[0-9]+$")
MAX_VERSION = 2**31 - 1  # MLflow's registry tables hold a version in an INTEGER column


@dataclass(frozen=True)
class RegistryModel:
    """One version of a registered model: what a ``models:/`` URI resolved to, as plain values."""

    uri: str  # as the user wrote it (models:/name@alias or models:/name/3)
    name: str
    version: str
    alias: str | None  # the alias the URI named, if any
    registry_uri: str  # the registry it was resolved in (MLflow's default made explicit)
    # The version's published model directory when its artifacts lie on a file system (a local or
    # shared path): read there like any published model, without MLflow. None: downloaded via MLflow.
    location: str | None = None

    @property
    def pinned_uri(self) -> str:
        """``models:/name/version``: this version, whatever the alias points at later."""
        return f"models:/{self.name}/{self.version}"

    def record(self) -> dict:
        """What a job records about the model it used (a scores marker, _scores.json)."""
        return {"uri": self.uri, "name": self.name, "version": self.version, "alias": self.alias,
                "registry_uri": self.registry_uri, "pinned_uri": self.pinned_uri}


def is_registry_uri(uri) -> bool:
    """Whether ``uri`` names a model in an MLflow registry rather than a storage location."""
    return isinstance(uri, str) and uri.strip().lower().startswith("models:/")


def parse_registry_uri(uri: str) -> tuple[str, str | None, str | None]:
    """(name, version, alias) of ``models:/NAME/VERSION`` or ``models:/NAME@ALIAS``; anything else
    (a stage, ``latest``, a logged model id, a bare name) is a DatasetError naming the URI."""
    rest = uri.strip()[len("models:/"):].lstrip("/")
    if "@" in rest:
        name, _, alias = rest.rpartition("@")
        if name and alias and "/" not in alias:
            return name, None, alias
    elif "/" in rest:
        name, _, version = rest.rpartition("/")
        if name and _VERSION.match(version):
            if int(version) > MAX_VERSION:
                raise DatasetError(f"{uri}: version {version} is beyond any registry's numbering (MLflow stores a "
                                   f"version as a 32-bit integer, at most {MAX_VERSION}); name a version the model has")
            return name, str(int(version)), None
    raise DatasetError(f"{uri}: not a model registry URI shardtrain reads; write models:/NAME/VERSION (a version "
                       "number) or models:/NAME@ALIAS")


def resolve_registry_model(uri: str, registry_uri: str | None = None) -> RegistryModel:
    """The version ``uri`` names now, asked of the registry (``registry_uri``, or MLflow's default)."""
    name, version, alias = parse_registry_uri(uri)
    client = _client(uri, registry_uri)
    where = f"registry {client._registry_uri}"
    with _registry_errors(uri, where):
        found = client.get_model_version_by_alias(name, alias) if alias else client.get_model_version(name, version)
    try:
        download_uri = client.get_model_version_download_uri(name, str(found.version))
    except Exception:  # noqa: BLE001 - a registry that will not say (Unity Catalog): MLflow's download finds it
        download_uri = None
    return RegistryModel(uri=uri.strip(), name=name, version=str(found.version), alias=alias,
                         registry_uri=client._registry_uri, location=_file_model_dir(download_uri))


def _file_model_dir(download_uri: str | None) -> str | None:
    """The published model directory inside a version's artifacts at ``download_uri``, when that is
    a local path or a file:// URI and its MLmodel names the directory (``ARTIFACT_KEY``); else None,
    and the version is downloaded through MLflow (which reports what is missing)."""
    from urllib.request import url2pathname

    parsed = urlparse(download_uri or "")
    if parsed.scheme not in ("", "file") or parsed.netloc not in ("", "localhost"):
        return None
    root = url2pathname(parsed.path)
    if not os.path.isabs(root):
        return None
    root = os.path.realpath(root)
    try:
        found = os.path.normpath(os.path.join(root, _artifact_path(os.path.join(root, "MLmodel"), download_uri)))
    except Exception:  # noqa: BLE001 - no MLmodel, not YAML, no such artifact: MLflow's download says which
        return None
    return found if found.startswith(root + os.sep) and os.path.isdir(found) else None


@contextlib.contextmanager
def registry_model_dir(uri: str, registry_uri: str | None = None) -> Iterator[tuple[str, str]]:
    """(local directory, name to show): the published model directory of the version ``uri``
    names, where it lies (``RegistryModel.location``) or else downloaded to a temporary directory
    (removed afterwards), and how messages about a file in it name it (the URI and the version it
    resolved to)."""
    model = resolve_registry_model(uri, registry_uri)
    shown = model.pinned_uri if model.alias is None else f"{model.uri} (version {model.version})"
    if model.location is not None:
        yield model.location, shown
        return
    from mlflow.store.artifact.models_artifact_repo import ModelsArtifactRepository

    with tempfile.TemporaryDirectory(prefix="shardtrain-registry-") as tmp, \
            mlflow_uris(_tracking_for(model.registry_uri), model.registry_uri):
        # MLflow's ModelsArtifactRepository looks the version up again through the process-wide
        # registry URI, whatever it is given: on a Spark worker (no MLFLOW_* variables) that is
        # another registry, which says the model does not exist. So it is set for the download.
        with _registry_errors(model.pinned_uri, f"registry {model.registry_uri}"):
            repo = ModelsArtifactRepository(model.pinned_uri, tracking_uri=_tracking_for(model.registry_uri),
                                            registry_uri=model.registry_uri)
            for sub in ("mlmodel", "model"):
                os.makedirs(os.path.join(tmp, sub))
            mlmodel = _download(repo, "MLmodel", os.path.join(tmp, "mlmodel"), model.pinned_uri, "its MLmodel file")
            path = _artifact_path(mlmodel, model.pinned_uri)
            local = _download(repo, path, os.path.join(tmp, "model"), model.pinned_uri,
                              f"the model directory {path!r} its MLmodel names")
        yield os.path.realpath(local), shown


@contextlib.contextmanager
def mlflow_uris(tracking_uri: str | None, registry_uri: str | None = None) -> Iterator[None]:
    """MLflow's process-wide tracking and registry URIs set for the block (None: left alone), then
    put back, with the MLFLOW_TRACKING_URI / MLFLOW_REGISTRY_URI variables MLflow's setters also
    write: for the MLflow calls that read only the globals."""
    from mlflow.tracking._model_registry import utils as registry_utils
    from mlflow.tracking._tracking_service import utils as tracking_utils

    saved = {name: os.environ.get(name) for name in ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")}
    before_tracking, before_registry = tracking_utils._tracking_uri, registry_utils._registry_uri
    if tracking_uri is not None:
        tracking_utils.set_tracking_uri(tracking_uri)
    if registry_uri is not None:
        registry_utils.set_registry_uri(registry_uri)
    try:
        yield
    finally:
        tracking_utils._tracking_uri, registry_utils._registry_uri = before_tracking, before_registry
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _download(repo, path: str, destination: str, uri: str, what: str) -> str:
    """One artifact of the version, downloaded; a missing one is exit 2 saying the version's
    artifacts are gone (deleted or moved in the artifact store), not that the model is foreign."""
    try:
        return repo.download_artifacts(path, dst_path=destination)
    except Exception as exc:  # noqa: BLE001 - MLflow raises OSError/MlflowException for a missing path
        if _unreachable(exc):
            raise
        raise DatasetError(f"{uri}: {what} is missing from the version's artifacts (deleted or moved in the artifact "
                           f"store?): {type(exc).__name__}: {first_line(exc)}") from None


def _artifact_path(mlmodel_file: str, uri: str) -> str:
    """Where the MLmodel file's pyfunc flavour keeps the published model directory (MLflow names
    it after the directory that was logged). An MLmodel that cannot be read and one that names no
    shardtrain model are exit 2, each said as what it is."""
    import yaml

    try:
        with open(mlmodel_file, encoding="utf-8") as fh:
            mlmodel = yaml.safe_load(fh)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise DatasetError(f"{uri}: its MLmodel file is damaged ({type(exc).__name__}: {first_line(exc)}); register "
                           "the model again") from None
    if not isinstance(mlmodel, dict):
        raise DatasetError(f"{uri}: its MLmodel file is damaged (not a YAML mapping); register the model again")
    try:
        return mlmodel["flavors"]["python_function"]["artifacts"][ARTIFACT_KEY]["path"]
    except (KeyError, TypeError):
        raise DatasetError(f"{uri}: has no pyfunc artifact {ARTIFACT_KEY!r}, so it is not a model shardtrain logged; "
                           "register the model that `shardtrain train` logs with tracking.mlflow") from None


def check_reachable(tracking_uri: str, what: str = "the tracking server") -> None:
    """Fail in seconds (StorageIOError naming the URI) on an http(s) server nobody answers at:
    MLflow itself would retry for minutes. Other URIs (sqlite, files, databricks) pass."""
    parsed = urlparse(tracking_uri or "")
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        return
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        socket.create_connection((parsed.hostname, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise StorageIOError(f"{what} {tracking_uri} is unreachable: cannot connect to {parsed.hostname}:{port}: "
                             f"{exc}") from None


def _client(uri: str, registry_uri: str | None):
    try:
        from mlflow.tracking import MlflowClient
    except ImportError as exc:
        raise StorageError(f"{uri}: a models:/ URI needs MLflow, which is not installed ({exc}); pip install "
                           "'shardtrain[mlflow]'") from None
    client = MlflowClient(tracking_uri=_tracking_for(registry_uri) if registry_uri else None, registry_uri=registry_uri)
    try:
        check_reachable(client._registry_uri, "the model registry")
    except StorageIOError as exc:
        raise StorageIOError(f"{uri}: {exc}") from None
    return client


def _tracking_for(registry_uri: str | None) -> str | None:
    """The tracking URI that goes with a registry: the same server, except for Databricks' own
    registries, whose models are found through the workspace's default tracking server. (A
    logged model's artifacts are located through the tracking store.)"""
    if not registry_uri or registry_uri.startswith(("databricks", "uc")):
        return None
    return registry_uri


def _unreachable(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}"
    return any(word in text for word in ("ConnectionError", "Connection refused", "Max retries exceeded",
                                         "Failed to establish", "timed out", "TEMPORARILY_UNAVAILABLE"))


@contextlib.contextmanager
def _registry_errors(uri: str, where: str) -> Iterator[None]:
    """MLflow's errors as ours, naming the URI: not found is exit 2, the registry unreachable exit 1."""
    try:
        yield
    except (DatasetError, StorageError):
        raise
    except Exception as exc:  # noqa: BLE001 - MlflowException, requests' errors, OSError
        code = getattr(exc, "error_code", "")
        if code in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND", "INVALID_PARAMETER_VALUE") and not _unreachable(exc):
            raise DatasetError(f"{uri}: not found in the {where} ({first_line(exc)})") from None
        raise StorageIOError(f"{uri}: the {where} cannot be read ({type(exc).__name__}: {first_line(exc)})") from None


__all__ = ["ARTIFACT_KEY", "RegistryModel", "check_reachable", "is_registry_uri", "mlflow_uris", "parse_registry_uri",
           "registry_model_dir", "resolve_registry_model"]
