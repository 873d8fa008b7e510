"""A published model, read back: the artifact's format (file names, model.json's fields, the
digests that bind them) and ``read_model``, which loads and verifies one for predictions.

Layout of a model directory (``training.export.publish_model`` writes it):

* ``model.safetensors``: the weights (no pickle);
* ``model.torchscript.pt``, where the model was published with one (``output.torchscript``): a
  TorchScript program taking the preprocessed tensors (``FeatureSpec.transform`` output) and
  returning class probabilities or regression values;
* ``model.code.pkl``, where the model was given to ``train(model=...)`` in code (a notebook's
  class): that code, pickled by value; rebuilding the model runs it, so it is read only with the
  caller's consent (``load_model(uri, trust_code=True)``);
* ``model.json``: resolved config, feature spec, label spec, metrics, the shard job's
  ``row_rules`` (``max_category_bytes``; absent from models published before it was recorded),
  and the sha256 and size of each file above (``files``); the ``_COMMITTED`` marker records
  model.json's own sha256.

``read_model(uri, program, build_network)`` verifies every file it reads against those digests
(a DatasetError names the damaged file) and never unpickles arbitrary objects. The caller chooses
what runs: ``program=True`` loads the TorchScript program (code + tensors only);
``program=False`` asks ``build_network(location, meta)`` for the network, which rebuilds it from
model.json and the verified weights (``verified_bytes``). No field of model.json switches between
them, so an edited model.json cannot change which code runs. Nor can it change what the outputs
mean: on load, the network (either kind) runs on a two-row probe batch built from model.json's
feature spec, and its output must be what model.json's label says (``[2, num_classes]``
probabilities, or ``[2]`` values); a disagreement is a DatasetError naming the field.

``LoadedModel.predict(frame)`` takes raw rows through the shard job's row rules first
(``common.rows.frame_refusals``: the rules ``shardtrain score`` applies in Spark), so a row that
cannot be taken never gets a number computed from an imputed or overflowed value: it raises
naming the row, or, with ``errors="mark"``, is marked with its reason in ``score_reason``.

Why here and not in training: scoring and the shard job's teacher read published models, and
neither may reach into training's modules. What only training knows stays there: the
architectures (``training.models``), hence ``build_network`` (``training.export.load_model``
passes the built-in MLP's), and the publishing side. This module must not import training, and
imports torch only when a model is loaded (``import common`` stays cheap).
"""

from __future__ import annotations

import hashlib
import io
import json
from typing import Callable

import numpy as np

from common.commit_marker import KIND_MODEL, MARKER
from common.dataset import LabelSpec
from common.features import FeatureSpec
from common.errors import DatasetError, InputDataError, StorageError, first_line
from common.model_registry import is_registry_uri
from common.rows import MAX_CATEGORY_BYTES, MEANING, Refusals, frame_refusals
from common.publish import read_marker, require_committed
from common.storage import Location, storage_errors
from common.tasks import LABEL_TASKS, class_list_problem, label_task, task_names

MODEL_FORMAT = KIND_MODEL
MODEL_FORMAT_VERSION = 3  # 3: ``features`` is the ordered list of records naming their kind (as a dataset's)
# 2: model.json records each file's sha256 (the marker records model.json's); ``features`` by kind,
# as common.features.v1 reads it.
MODEL_READABLE_VERSIONS = (2, 3)
WEIGHTS, PROGRAM, META = "model.safetensors", "model.torchscript.pt", "model.json"
CODE = "model.code.pkl"  # the model, loss and metrics given to train() in code (cloudpickle): run only if trusted
ROW_RULES = "row_rules"  # model.json's record of the shard job's row rules: {"max_category_bytes": 1024}
# The output columns, named as ``shardtrain score`` names them (scoring.predict).
PROBABILITIES, PREDICTION, REASON = "probabilities", "prediction", "score_reason"
ERRORS = ("raise", "mark")  # what predict does with a row the row rules refuse


class LoadedModel:
    """A published model: ``predict(frame)`` on raw feature columns, ``meta`` is model.json
    (``features`` and ``label`` its feature spec and label, parsed)."""

    def __init__(self, module, meta: dict, fingerprint: str | None = None, network_file: str = WEIGHTS):
        import torch

        self.module = module.eval()  # a torch nn.Module: the served network (a ServingModel, or its program)
        self.meta = meta
        # sha256 of the model.json this was loaded from (the commit marker's model_json_sha256):
        # the model's identity, which a job records and compares (scoring, teacher soft targets).
        self.fingerprint = fingerprint
        self.network_file = network_file  # WEIGHTS or PROGRAM: the file the network was loaded from
        self.features = FeatureSpec(meta["features"], (meta.get(ROW_RULES) or {}).get("max_category_bytes"))
        self.label = LabelSpec.from_record(meta["label"])
        self.device = torch.device("cpu")

    @property
    def weights_sha256(self) -> str:
        """The recorded sha256 of the file the network came from: what a worker that loads the
        model again compares, to be sure it runs the same network as the driver checked."""
        return self.meta["files"][self.network_file]["sha256"]

    @property
    def task(self) -> str:
        return self.label.task

    @property
    def metrics(self) -> list[dict]:
        return self.meta.get("metrics", [])

    def to(self, device) -> "LoadedModel":
        """Run the network on ``device`` (``"cuda"``, ``"cpu"``); inputs and results stay numpy."""
        import torch

        self.device = torch.device(device)
        self.module.to(self.device)
        return self

    def predict(self, frame, temperature: float = 1.0, errors: str = "raise"):
        """pandas DataFrame or Arrow table of raw feature columns -> predictions, for the rows the
        shard job's row rules take (``common.rows``: the rules of ``shardtrain score``); a row
        that breaks one (1e300, inf, text that is not a number or not UTF-8, a category longer
        than the shard job took, an array of another shape) gets no prediction computed at all.

        ``errors="raise"`` (default): such a row raises InputDataError (exit 2) naming its index
        label, its column and the reason; else the result is as it always was: probabilities
        [n, classes] (classification) or values [n] (regression), a float32 numpy array. A label
        that names its classes (``classes``, in probability order) gives a pandas DataFrame on the
        frame's index instead: ``probabilities`` (a float32 array per row) and ``prediction``
        (the most probable class's name), as ``score`` writes them; so does a multilabel label,
        whose ``prediction`` is the list of classes (names, or indices) at or above its
        ``threshold``, and whose probabilities are each class's own (a sigmoid each).

        ``errors="mark"``: a pandas DataFrame with a row for every row of ``frame``, on its index
        (an Arrow table's: 0..n-1): ``probabilities`` (a float32 array per row; classification)
        or ``prediction`` (float32; regression), then ``score_reason``: None where the row was
        taken, else the reason ``shardtrain score`` gives it (``non_finite:x1``, ``too_long:city``,
        ``bad_encoding``, ...) and no prediction (probabilities None, a value NaN). Unlike
        ``score``, no ``prediction`` class column for classes by index: a number column beside
        the probabilities is what MLflow's spark_udf would take in their place for the
        ``ArrayType(FloatType())`` result users asked of it before. Named classes add the
        ``prediction`` column of names (None for a refused row) after the probabilities.

        An empty frame gives an empty result of the same form. See ``predict_arrays`` for
        ``temperature``."""
        if errors not in ERRORS:
            raise ValueError(f"errors must be one of {', '.join(ERRORS)}, got {errors!r}")
        self.features.require_columns(frame)
        refusals = frame_refusals(frame, self.features)
        taken, first = refusals.taken, refusals.first
        if errors == "raise" and first is not None:
            raise InputDataError(_refusal_message(frame, refusals, first))
        rows = frame if first is None else _rows_at(frame, np.flatnonzero(taken))
        values = self.predict_arrays(self.features.transform(rows), temperature)
        if errors == "mark":
            return self._outputs(frame, values, taken, refusals.reasons)
        framed = self.classes is not None or label_task(self.task).multi
        return self._outputs(frame, values, taken) if framed else values

    @property
    def classes(self) -> list[str] | None:
        """The class names in probability order, where the label names them; else None."""
        return None if self.label.classes is None else list(self.label.classes)

    def _outputs(self, frame, values: np.ndarray, taken: np.ndarray, reasons: np.ndarray | None = None):
        """``predict``'s frame: the taken rows' values in place (the probabilities, and the class
        names where the label names them; or the value), and with errors="mark" the reasons beside."""
        import pandas as pd

        index = pd.RangeIndex(frame.num_rows) if hasattr(frame, "num_rows") else frame.index
        columns = {}
        if self.label.classification:
            outputs = np.full(len(taken), None, dtype=object)
            for position, row in zip(np.flatnonzero(taken), values):
                outputs[position] = row
            columns[PROBABILITIES] = outputs
            predicted = self._predicted(values)
            if predicted is not None:
                names = np.full(len(taken), None, dtype=object)
                for position, classes in zip(np.flatnonzero(taken), predicted):
                    names[position] = classes
                columns[PREDICTION] = names
        else:
            outputs = np.full(len(taken), np.nan, dtype=np.float32)
            outputs[taken] = values
            columns[PREDICTION] = outputs
        if reasons is not None:
            columns[REASON] = reasons
        return pd.DataFrame(columns, index=index)

    def _predicted(self, probabilities: np.ndarray) -> list | None:
        """Each row's prediction: its class's name (a label of named classes), or the list of
        classes at or above the threshold (multilabel: names, or indices); None for a label of
        indices with one class per row (its prediction is the probabilities' argmax, as ever)."""
        if label_task(self.task).multi:
            names = self.classes or list(range(self.label.num_classes))
            return [[names[i] for i in np.flatnonzero(row >= self.label.threshold)] for row in probabilities]
        if self.classes is None:
            return None
        return list(np.asarray(self.classes, dtype=object)[probabilities.argmax(axis=1)])

    def predict_arrays(self, arrays: dict, temperature: float = 1.0) -> np.ndarray:
        """Already-preprocessed arrays (as stored in the dataset / produced by FeatureSpec.transform).

        Classification at ``temperature`` T gives softmax(logits / T): T = 1 is the model's own
        probabilities, T > 1 softer ones (a teacher's soft targets for distillation); multilabel,
        sigmoid(logits / T), each class its own. Regression values do not depend on T.
        """
        import torch

        if not (isinstance(temperature, (int, float)) and np.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
        if len(next(iter(arrays.values()))) == 0:  # no rows: a network's reshape of 0 elements has no size to infer
            return np.zeros((0, *self.label.output_shape), dtype=np.float32)
        batch = {name: torch.from_numpy(np.ascontiguousarray(value)).to(self.device) for name, value in arrays.items()}
        with torch.no_grad():
            if self.label.classification and temperature != 1:
                # .net is the network before the softmax or sigmoid (training.export.ServingModel's,
                # training.tasks.multilabel_serving's, in the TorchScript program too).
                logits = self.module.net(batch).float() / float(temperature)
                out = torch.sigmoid(logits) if label_task(self.task).multi else torch.softmax(logits, dim=-1)
            else:
                out = self.module(batch)
            return out.float().cpu().numpy()


def _rows_at(frame, positions: np.ndarray):
    """The rows of a pandas DataFrame or Arrow table at ``positions``."""
    return frame.take(positions) if hasattr(frame, "num_rows") else frame.iloc[positions]


def _refusal_message(frame, refusals: Refusals, position: int) -> str:
    """One line naming the first refused row (its index label), its column, value and reason."""
    column, reason = refusals.columns[position], refusals.reasons[position]
    if hasattr(frame, "num_rows"):
        label, value = position, frame.column(column)[position].as_py()
    else:
        label, value = frame.index[position], frame[column].iloc[position]
    refused = int((~refusals.taken).sum())
    return (f"row {label!r}, column {column!r} (value {_shown(value)}): {reason} ({MEANING[reason.split(':')[0]]}); "
            f"{refused} of {len(refusals.reasons)} rows cannot be taken and none was scored: fix the values, or "
            "call predict(frame, errors='mark') to score the others and mark each refused row's reason")


def _shown(value) -> str:
    """A value as a message shows it: its repr (a numpy scalar's as the Python number's, on
    every numpy), cut short (a category may hold megabytes)."""
    text = repr(value.item() if isinstance(value, np.generic) else value)
    if len(text) <= 40:
        return text
    size = f", {len(value):,} characters" if isinstance(value, (str, bytes)) else ""
    return f"{text[:30]}...{size}"


def read_model(uri: str, program: bool, build_network: Callable[[Location, dict], object],
               registry_uri: str | None = None) -> LoadedModel:
    """The published model at ``uri``, verified: its TorchScript program (``program=True``), or
    the network ``build_network(location, meta)`` returns (an ``nn.Module`` taking the batch dict
    and returning what the program returns; it reads the weights with ``verified_bytes``).

    ``uri`` may be a ``models:/`` URI (common.model_registry): the version it names in the registry
    (``registry_uri``, or MLflow's default) is read from its artifacts and verified like any model."""
    if is_registry_uri(uri):
        from common.model_registry import registry_model_dir

        with registry_model_dir(uri, registry_uri) as (local, shown):  # all is read into memory before a download goes
            # Named as the URI and its version: a damaged file is reported as the registry's, not a temporary copy.
            loc = Location(uri=shown, scheme="file", path=local)
            return _read_committed(require_committed(loc, "model"), program, build_network)
    try:
        loc = require_committed(uri, "model")
    except StorageError as exc:  # keep its message, but as the dataset-contract exit status 2
        raise DatasetError(str(exc)) from None
    return _read_committed(loc, program, build_network)


def _read_committed(loc: Location, program: bool, build_network) -> LoadedModel:
    meta, fingerprint = _read_meta(loc)
    if program:
        if PROGRAM not in (meta.get("files") or {}):
            raise DatasetError(f"{loc.uri}: the model was published without a TorchScript program "
                               "(output.torchscript: never, or torch.jit.script could not compile it); load it "
                               "rebuilt from its weights: load_model(uri) or score's program: false")
        module = _load_program(loc, verified_bytes(loc, meta, PROGRAM))
    else:
        module = build_network(loc, meta)
    model = LoadedModel(module, meta, fingerprint, PROGRAM if program else WEIGHTS)
    model.features.attach(loc)  # its features' side files (a tokenizer), checked against their sha256
    return _checked_against_network(loc, model)


def _checked_against_network(loc: Location, model: LoadedModel) -> LoadedModel:
    """``model``, after checking that its network takes model.json's features and gives what
    model.json's label says. A forward pass rather than the weights' shapes: it holds for a
    plug-in's TorchScript program as for the built-in MLP."""
    where = f"{loc.uri}/{META}"
    try:
        out = model.predict_arrays(model.features.probe(2))
    except Exception as exc:  # noqa: BLE001 - the network's own error on inputs of the wrong shape
        raise DatasetError(f"{where}: field 'features' ({model.features.summary()}) does not match the "
                           f"inputs the network takes ({type(exc).__name__}: {first_line(exc)}); the file was edited "
                           "or damaged: re-train, or re-publish the model") from None
    label = model.label
    found = f"the network outputs shape {list(out.shape)} for 2 rows"
    if label.classification:
        if out.ndim != 2:
            raise DatasetError(f"{where}: field 'label.task' is '{label.task}', but {found} (values, not class "
                               "probabilities); the file was edited or damaged: re-train, or re-publish the model")
        if out.shape[1] != label.num_classes:
            raise DatasetError(f"{where}: field 'label.num_classes' is {label.num_classes}, but {found} "
                               f"({out.shape[1]} classes); the file was edited or damaged: re-train, or re-publish "
                               "the model")
    elif out.ndim != 1:
        raise DatasetError(f"{where}: field 'label.task' is '{label.task}', but {found} (one value per row "
                           "expected); the file was edited or damaged: re-train, or re-publish the model")
    return model


def read_meta(loc: Location) -> dict:
    """model.json of the committed model at ``loc``, checked as ``read_model`` checks it (against
    the sha256 its commit marker records; the fields loading reads), without loading the model."""
    return _read_meta(loc)[0]


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
    if meta.get("format") != MODEL_FORMAT or meta.get("format_version") not in MODEL_READABLE_VERSIONS:
        raise DatasetError(f"{loc.uri}/{META}: format {meta.get('format')!r} version {meta.get('format_version')!r} "
                           f"is not a model this shardtrain reads ({MODEL_FORMAT} v{'/'.join(map(str, MODEL_READABLE_VERSIONS))}); re-train "
                           "it with this version")
    if not recorded:
        raise DatasetError(f"{loc.uri}: its {MARKER} marker records no sha256 for {META}; re-publish the model")
    _check_meta_fields(f"{loc.uri}/{META}", meta)
    return meta, recorded


def _check_meta_fields(where: str, meta: dict) -> None:
    """The fields loading and scoring read, of the types they need (named when they are not)."""
    label = meta.get("label")
    if not isinstance(label, dict) or label.get("task") not in LABEL_TASKS:
        task = label.get("task") if isinstance(label, dict) else None
        raise DatasetError(f"{where}: field 'label.task' is {task!r}, not {task_names(quote=True)}; "
                           "re-train, or re-publish the model")
    classes = label.get("num_classes")
    if label_task(label["task"]).classes and not (type(classes) is int and classes >= 2):
        raise DatasetError(f"{where}: field 'label.num_classes' is {classes!r}; a classifier has an integer >= 2 "
                           "classes: re-train, or re-publish the model")
    problem = class_list_problem(label.get("classes"), classes)
    if problem is not None:
        raise DatasetError(f"{where}: field 'label.classes' {problem}: re-train, or re-publish the model")
    rules = meta.get(ROW_RULES, {})  # absent from models published before it was recorded
    if not isinstance(rules, dict):  # loading reads it as a mapping
        raise DatasetError(f"{where}: field '{ROW_RULES}' is {rules!r}; expected an object: re-train, or re-publish "
                           "the model")
    limit = rules.get("max_category_bytes")
    if limit is not None and not (type(limit) is int and 1 <= limit <= MAX_CATEGORY_BYTES):
        raise DatasetError(f"{where}: field '{ROW_RULES}.max_category_bytes' is {limit!r}; expected an integer in "
                           f"[1, {MAX_CATEGORY_BYTES}]: re-train, or re-publish the model")
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


def verified_bytes(loc: Location, meta: dict, name: str) -> bytes:
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


def _load_program(loc: Location, data: bytes):
    import torch

    try:
        return torch.jit.load(io.BytesIO(data), map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError/ValueError subclasses for bad archives
        raise DatasetError(f"{loc.uri}/{PROGRAM}: cannot be loaded as a TorchScript program "
                           f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None


__all__ = ["CODE", "ERRORS", "META", "MODEL_FORMAT", "MODEL_FORMAT_VERSION", "PREDICTION", "PROBABILITIES", "PROGRAM", "REASON",
           "ROW_RULES", "WEIGHTS", "LoadedModel", "read_meta", "read_model", "verified_bytes"]
