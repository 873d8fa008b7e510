"""The trained model in storage, and loading it back for predictions.

``publish_model`` writes, atomically (common.storage.publish: staging, rename, marker last):

* ``model.safetensors``: the weights (no pickle);
* ``model.torchscript.pt``: a TorchScript program for serving; it takes the preprocessed tensors
  (``FeatureSpec.transform`` output) and returns class probabilities or regression values;
* ``model.json``: how to rebuild and use it: resolved config, feature spec (vocabularies,
  normalization statistics), label spec, per-epoch metrics, baseline, the dataset manifest's
  fingerprint, library versions, and the sha256 and size of each file above (``files``).

The ``_COMMITTED`` marker records ``kind: shardtrain.model`` (so ``overwrite`` replaces only a
model), model.json's own sha256, and the id of the training run that published it (model.json
has it as ``run_id`` too): ranks relaunched after a failure that came after the publish find
their own run's model there (``published_by``) and finish without publishing again.

``load_model(uri, program=False)`` verifies every file it reads against those digests (a
DatasetError names the damaged file) and never unpickles arbitrary objects. The caller chooses
what runs: by default the built-in MLP, rebuilt from model.json and safetensors (a plug-in model
is refused with the advice to pass ``program=True``); ``program=True`` loads the TorchScript
program (code + tensors only). No field of model.json switches between them, so an edited
model.json cannot change which code runs. Nor can it change what the outputs mean: on load, the
network (either kind, a plug-in's program too) runs on a two-row probe batch built from
model.json's feature spec, and its output must be what model.json's label says (``[2,
num_classes]`` probabilities, or ``[2]`` values); a disagreement is a DatasetError naming the
field. ``.predict(frame)`` applies the training preprocessing to raw feature columns.
"""

from __future__ import annotations

import hashlib
import io
import json
import platform
from typing import Dict

import numpy as np
import torch
from torch import nn

from common.errors import DatasetError, StorageError, first_line
from common.dataset import FeatureSpec
from common.storage import MARKER as MARKER_NAME
from common.storage import (KIND_MODEL, Location, is_committed, publish, read_marker, require_committed, resolve,
                            storage_errors)

MODEL_FORMAT = KIND_MODEL
MODEL_FORMAT_VERSION = 2  # 2: model.json records each file's sha256; the marker records model.json's
WEIGHTS, PROGRAM, META = "model.safetensors", "model.torchscript.pt", "model.json"


class ServingModel(nn.Module):
    """The trained network plus its output transform: probabilities, or de-standardized values."""

    def __init__(self, net: nn.Module, regression: bool, target_mean: float = 0.0, target_std: float = 1.0):
        super().__init__()
        self.net = net
        self.regression = regression
        self.target_mean, self.target_std = float(target_mean), float(target_std)

    def forward(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        out = self.net(batch)
        if self.regression:
            return out * self.target_std + self.target_mean
        return torch.softmax(out.float(), dim=-1)


def target_scaling(label_spec: dict) -> tuple[float, float]:
    """Regression targets are trained standardized (mean 0, std 1) for a well-scaled loss."""
    if label_spec.get("task") == "classification":
        return 0.0, 1.0
    std = float(label_spec.get("train_std") or 1.0)
    return float(label_spec.get("train_mean") or 0.0), std if std > 0 else 1.0


def serving_model(net: nn.Module, label_spec: dict) -> ServingModel:
    mean, std = target_scaling(label_spec)
    return ServingModel(net, label_spec.get("task") != "classification", mean, std)


def publish_model(uri: str, mode: str, net: nn.Module, meta: dict, example_batch: dict, run_id: str) -> str:
    """Write the model directory at ``uri`` atomically; ``meta`` becomes model.json (plus versions).
    ``run_id``: the training run publishing it (``RankPlan.run_id``)."""
    net = net.to("cpu").eval()
    serving = serving_model(net, meta["label"])
    weights = {k: v.detach().contiguous() for k, v in net.state_dict().items()}
    program = _program(serving, {k: v.to("cpu") for k, v in example_batch.items()})
    from safetensors.torch import save as save_safetensors

    blobs = {WEIGHTS: save_safetensors(weights), PROGRAM: program}
    files = {name: {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)} for name, data in blobs.items()}
    record = {"format": MODEL_FORMAT, "format_version": MODEL_FORMAT_VERSION, **meta, "versions": versions(),
              "files": files, "run_id": run_id}
    text = json.dumps(record, indent=2, sort_keys=True)
    marker = {"kind": KIND_MODEL, "format": MODEL_FORMAT, "run_id": run_id,
              "model_json_sha256": hashlib.sha256(text.encode()).hexdigest()}
    with publish(uri, mode=mode, marker=marker) as staging:
        for name, data in blobs.items():
            with storage_errors(f"writing {name}", staging.uri), staging.open(name, "wb") as fh:
                fh.write(data)
        staging.write_text(META, text)
    return uri


def published_by(uri: str, run_id: str) -> bool:
    """Whether ``uri`` holds a committed model that the training run ``run_id`` published."""
    loc = resolve(uri)
    with storage_errors("checking what the model path holds", loc.uri):
        if not is_committed(loc):
            return False
        marker = read_marker(loc)
    return marker.get("kind") == KIND_MODEL and marker.get("run_id") == run_id


def _program(serving: ServingModel, example: dict) -> bytes:
    try:
        scripted = torch.jit.script(serving)
    except Exception:  # noqa: BLE001 - a plug-in model may not be scriptable; tracing is the fallback
        scripted = torch.jit.trace(serving, (example,), strict=False)
    buffer = io.BytesIO()
    torch.jit.save(scripted, buffer)
    return buffer.getvalue()


def versions() -> dict:
    import pyarrow

    from common import __version__

    found = {"shardtrain": __version__, "python": platform.python_version(), "torch": torch.__version__,
             "numpy": np.__version__, "pyarrow": pyarrow.__version__}
    for name in ("horovod", "petastorm", "pyspark", "safetensors"):
        try:
            found[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - a version we cannot read is simply not recorded
            pass
    return found


class LoadedModel:
    """A published model: ``predict(frame)`` on raw feature columns, ``meta`` is model.json."""

    def __init__(self, module: nn.Module, meta: dict, fingerprint: str | None = None):
        self.module = module.eval()
        self.meta = meta
        # sha256 of the model.json this was loaded from (the commit marker's model_json_sha256):
        # the model's identity, which a job records and compares (scoring, teacher soft targets).
        self.fingerprint = fingerprint
        self.features = FeatureSpec(meta["features"])
        self.device = torch.device("cpu")

    @property
    def task(self) -> str:
        return self.meta["label"]["task"]

    @property
    def metrics(self) -> list[dict]:
        return self.meta.get("metrics", [])

    def to(self, device) -> "LoadedModel":
        """Run the network on ``device`` (``"cuda"``, ``"cpu"``); inputs and results stay numpy."""
        self.device = torch.device(device)
        self.module.to(self.device)
        return self

    def predict(self, frame, temperature: float = 1.0) -> np.ndarray:
        """pandas DataFrame or Arrow table of raw feature columns -> probabilities [n, classes]
        (classification) or values [n] (regression). See ``predict_arrays`` for ``temperature``."""
        arrays = self.features.transform(frame)
        return self.predict_arrays(arrays, temperature)

    def predict_arrays(self, arrays: dict, temperature: float = 1.0) -> np.ndarray:
        """Already-preprocessed arrays (as stored in the dataset / produced by FeatureSpec.transform).

        Classification at ``temperature`` T gives softmax(logits / T): T = 1 is the model's own
        probabilities, T > 1 softer ones (a teacher's soft targets for distillation). Regression
        values do not depend on T.
        """
        if not (isinstance(temperature, (int, float)) and np.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
        batch = {name: torch.from_numpy(np.ascontiguousarray(value)).to(self.device) for name, value in arrays.items()}
        with torch.no_grad():
            if self.task == "classification" and temperature != 1:
                # ServingModel.net is the network before the softmax (also in the TorchScript program).
                out = torch.softmax(self.module.net(batch).float() / float(temperature), dim=-1)
            else:
                out = self.module(batch)
            return out.float().cpu().numpy()


def load_model(uri: str, program: bool = False) -> LoadedModel:
    """Load a published model, verifying each file it reads against the recorded sha256.

    ``program=False`` (default): the built-in MLP, rebuilt from model.json and safetensors; a
    plug-in model is refused (it has no built-in architecture). ``program=True``: the TorchScript
    program. The choice is the caller's alone; no field of model.json can switch it.
    """
    try:
        loc = require_committed(uri, "model")
    except StorageError as exc:  # keep its message, but as the dataset-contract exit status 2
        raise DatasetError(str(exc)) from None
    meta, fingerprint = _read_meta(loc)
    if program:
        module = _load_program(loc, _verified_bytes(loc, meta, PROGRAM))
        return _checked_against_network(loc, LoadedModel(module, meta, fingerprint))
    name = (meta.get("model") or {}).get("name")
    arguments = (meta.get("model") or {}).get("arguments")
    if name != "mlp":
        raise DatasetError(f"{loc.uri}: model {name!r} is a plug-in model with no built-in architecture; load its "
                           "TorchScript program with load_model(uri, program=True)")
    if not isinstance(arguments, dict):
        raise DatasetError(f"{loc.uri}/{META}: field 'model.arguments' is {arguments!r}, but the built-in model needs "
                           "its arguments; the file was edited or damaged: re-train, or load the program with "
                           "load_model(uri, program=True)")
    from safetensors import SafetensorError
    from safetensors.torch import load as load_safetensors

    from training.models import TabularMLP

    data = _verified_bytes(loc, meta, WEIGHTS)
    try:
        net = TabularMLP(**arguments)
        net.load_state_dict(load_safetensors(data))
    except (SafetensorError, RuntimeError, TypeError, ValueError) as exc:
        raise DatasetError(f"{loc.uri}/{WEIGHTS}: cannot be loaded as the built-in model's weights "
                           f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); re-train or "
                           "re-publish the model") from None
    return _checked_against_network(loc, LoadedModel(serving_model(net, meta["label"]), meta, fingerprint))


def _probe_batch(spec: FeatureSpec) -> dict:
    """Two rows of the inputs the network takes: zeros, then each category's largest index (an
    embedding table smaller than model.json's vocabulary fails on it)."""
    categorical = np.zeros((2, len(spec.categorical)), dtype=np.int64)
    categorical[1] = [spec.num_embeddings(name) - 1 for name in spec.categorical]
    return {"numeric": np.zeros((2, len(spec.numeric)), dtype=np.float32), "categorical": categorical,
            **{name: np.zeros((2, *shape), dtype=np.float32) for name, shape in spec.arrays.items()}}


def _checked_against_network(loc: Location, model: LoadedModel) -> LoadedModel:
    """``model``, after checking that its network takes model.json's features and gives what
    model.json's label says. A forward pass rather than the weights' shapes: it holds for a
    plug-in's TorchScript program as for the built-in MLP."""
    where = f"{loc.uri}/{META}"
    try:
        out = model.predict_arrays(_probe_batch(model.features))
    except Exception as exc:  # noqa: BLE001 - the network's own error on inputs of the wrong shape
        raise DatasetError(f"{where}: field 'features' ({_feature_summary(model.features)}) does not match the "
                           f"inputs the network takes ({type(exc).__name__}: {first_line(exc)}); the file was edited "
                           "or damaged: re-train, or re-publish the model") from None
    label = model.meta["label"]
    found = f"the network outputs shape {list(out.shape)} for 2 rows"
    if label["task"] == "classification":
        if out.ndim != 2:
            raise DatasetError(f"{where}: field 'label.task' is 'classification', but {found} (values, not class "
                               "probabilities); the file was edited or damaged: re-train, or re-publish the model")
        if out.shape[1] != label["num_classes"]:
            raise DatasetError(f"{where}: field 'label.num_classes' is {label['num_classes']}, but {found} "
                               f"({out.shape[1]} classes); the file was edited or damaged: re-train, or re-publish "
                               "the model")
    elif out.ndim != 1:
        raise DatasetError(f"{where}: field 'label.task' is 'regression', but {found} (one value per row "
                           "expected); the file was edited or damaged: re-train, or re-publish the model")
    return model


def _feature_summary(spec: FeatureSpec) -> str:
    arrays = ", ".join(f"{name} {list(shape)}" for name, shape in spec.arrays.items())
    return (f"{len(spec.numeric)} numeric, {len(spec.categorical)} categorical"
            + (f", arrays {arrays}" if arrays else ""))


def _read_meta(loc: Location) -> tuple[dict, str]:
    """model.json, checked against the sha256 its commit marker records, and that sha256."""
    raw = _read_bytes(loc, META, f"{loc.uri}: committed but has no {META}; it is not a shardtrain model")
    with storage_errors(f"reading {META}", loc.uri):
        marker = read_marker(loc)
    if marker.get("kind", marker.get("format")) != MODEL_FORMAT:
        raise DatasetError(f"{loc.uri}: holds a {marker.get('kind') or 'output of another kind'}, not a {MODEL_FORMAT}")
    recorded = marker.get("model_json_sha256")
    if recorded and hashlib.sha256(raw).hexdigest() != recorded:
        raise DatasetError(f"{loc.uri}/{META}: does not match the sha256 recorded when the model was published; it was "
                           "edited or damaged: re-train, or re-publish the model")
    try:
        meta = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise DatasetError(f"{loc.uri}/{META}: not valid JSON ({first_line(exc)}); re-train, or re-publish the "
                           "model") from None
    if not isinstance(meta, dict):
        raise DatasetError(f"{loc.uri}/{META}: holds a JSON {type(meta).__name__}, not the object a model.json is; "
                           "re-train, or re-publish the model")
    if meta.get("format") != MODEL_FORMAT or meta.get("format_version") != MODEL_FORMAT_VERSION:
        raise DatasetError(f"{loc.uri}/{META}: format {meta.get('format')!r} version {meta.get('format_version')!r} "
                           f"is not a model this shardtrain reads ({MODEL_FORMAT} v{MODEL_FORMAT_VERSION}); re-train "
                           "it with this version")
    if not recorded:
        raise DatasetError(f"{loc.uri}: its {MARKER_NAME} marker records no sha256 for {META}; re-publish the model")
    _check_meta_fields(f"{loc.uri}/{META}", meta)
    return meta, recorded


def _check_meta_fields(where: str, meta: dict) -> None:
    """The fields loading and scoring read, of the types they need (named when they are not)."""
    label = meta.get("label")
    if not isinstance(label, dict) or label.get("task") not in ("classification", "regression"):
        task = label.get("task") if isinstance(label, dict) else None
        raise DatasetError(f"{where}: field 'label.task' is {task!r}, not 'classification' or 'regression'; "
                           "re-train, or re-publish the model")
    classes = label.get("num_classes")
    if label["task"] == "classification" and not (type(classes) is int and classes >= 2):
        raise DatasetError(f"{where}: field 'label.num_classes' is {classes!r}; a classifier has an integer >= 2 "
                           "classes: re-train, or re-publish the model")
    try:
        FeatureSpec(meta.get("features"))
    except Exception as exc:  # noqa: BLE001 - KeyError / TypeError from a spec of the wrong shape
        raise DatasetError(f"{where}: field 'features' is not a feature spec ({type(exc).__name__}: "
                           f"{first_line(exc)}); re-train, or re-publish the model") from None


def _read_bytes(loc: Location, name: str, missing: str) -> bytes:
    """A model file's bytes; ``missing``: the DatasetError's message when it is not there."""
    with storage_errors(f"reading {name}", loc.uri):
        try:
            with loc.open(name, "rb") as fh:
                return fh.read()
        except FileNotFoundError:
            raise DatasetError(missing) from None


def _verified_bytes(loc: Location, meta: dict, name: str) -> bytes:
    """The file's bytes, after checking them against the sha256 and size model.json records."""
    entry = (meta.get("files") or {}).get(name)
    if not isinstance(entry, dict) or "sha256" not in entry:
        raise DatasetError(f"{loc.uri}/{META}: field 'files.{name}.sha256' is missing, so {name} cannot be verified; "
                           "re-publish the model")
    data = _read_bytes(loc, name, f"{loc.uri}/{name}: missing from the published model; re-train it")
    if len(data) != entry.get("bytes", len(data)) or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise DatasetError(f"{loc.uri}/{name}: does not match the sha256 recorded in {META}; the file was damaged or "
                           "replaced after the model was published: re-train, or restore the file")
    return data


def _load_program(loc: Location, data: bytes) -> nn.Module:
    try:
        return torch.jit.load(io.BytesIO(data), map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError/ValueError subclasses for bad archives
        raise DatasetError(f"{loc.uri}/{PROGRAM}: cannot be loaded as a TorchScript program "
                           f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None


__all__ = ["LoadedModel", "ServingModel", "load_model", "publish_model", "published_by", "serving_model",
           "target_scaling"]
