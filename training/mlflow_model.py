"""A published model as an MLflow model: the pyfunc flavour, its signature and input example,
logging it with the training run, and registering the logged model as a version.

``ShardtrainPyfunc.predict(context, frame)`` is ``load_model(dir).predict(frame, errors=...)``: the
same row rules (``common.rows``: a row the shard job or ``shardtrain score`` refuses gets no
prediction), the same preprocessing fitted on train. Models logged from now on mark refused
rows (``model_config`` ``{"errors": "mark"}``): their output is a frame of ``probabilities``
(an array per row; classification, then ``prediction``: the class's name where the label names
its classes; multilabel, the list of classes at or above its threshold) or ``prediction``
(regression), null for a refused row, and ``score_reason`` (null where the row was taken, else
its reason, as ``score`` writes it).
Marking is the default because a pyfunc scores batches (``spark_udf``, Model Serving, batch
inference): one bad row must not fail every other row of its batch, and the reason says which
rows have no prediction and why. (In a ``spark_udf`` struct, MLflow writes a null string beside
a reason as the text 'None' or 'nan': a null ``probabilities`` is what tells a refused row
there.) ``mlflow.pyfunc.load_model(uri, model_config={"errors": "raise"})`` gives ``predict``'s
default instead: the float32 array, or InputDataError naming the first refused row. Models
logged before have no model_config and keep their signature (a float32 tensor of probabilities
``[n, classes]`` or values ``[n]``): they predict as they did, and raise on a row the rules
refuse, as their output has no place for a reason.

Its one artifact, ``common.model_registry.ARTIFACT_KEY``, is the published model
directory as it is (``model.safetensors``, ``model.torchscript.pt``, ``model.json``,
``_COMMITTED``), and loading goes through ``training.export.load_model``, which checks every file
against its sha256: a damaged artifact is refused naming the file. Nothing is unpickled: the
model is logged as "models from code" (``PYFUNC_CODE``, a file that builds the PythonModel when
MLflow loads it), never as a cloudpickled object; the input example is JSON. The one exception is
a model trained from code given to ``train(model=...)``, which holds that code pickled: it is run
only when the loader passes ``model_config={"trust_code": True}`` (``load_model``'s ``trust_code``).

The signature lists every raw feature column the model reads. Numeric and categorical features
are ``any``: the shard job takes several raw types for each (numbers of any width, booleans,
numeric text; any scalar as a category), and no MLflow type admits both the int64 and the
float64 column pandas reads from one source (CSV or Parquet integers, int64 without a null and
float64 with one; Spark's toPandas() the same), so MLflow's enforcement would refuse the frame a
user has (``long`` refuses float64, ``double`` int64, ``string`` int64). The row rules decide
per row instead, as in the shard job. Array features are ``array<double>`` (float32 arrays
convert to it exactly; MLflow has no fixed-shape tensor type for a column beside others, and a
schema cannot mix columns and tensors; the shape is model.json's). The outputs are the columns
above (``output_schema``), ``score_reason`` among them. The input example is the validation split's first rows (else train's), decoded back to raw
values from their stored encodings (numbers un-standardized, category indices back to words; an
unseen category becomes a word outside the vocabulary).

Pip requirements: what loading and predicting need (shardtrain pinned to this version, torch,
numpy, pandas, pyarrow, safetensors, fsspec, pyyaml): no Spark, no Horovod.

Only training.tracking calls ``log_and_register`` (rank 0, on the tracking thread, within
``tracking.mlflow.timeout_s``). MLflow's ``log_model`` reads its tracking URI from MLflow's global
state, so it is set for the duration of the call only, and put back as it was (environment
variable included): a notebook's own MLflow setup is left as it was.
"""

from __future__ import annotations

import contextlib
import logging
import os

import mlflow.pyfunc
import numpy as np
import pandas as pd

from common import __version__
from common.dataset import LabelSpec, read_manifest
from common.features import FeatureSpec
from common.errors import first_line
from common.model_artifact import PREDICTION, PROBABILITIES, REASON
from common.model_registry import ARTIFACT_KEY, check_reachable, mlflow_uris
from common.tasks import label_task

log = logging.getLogger("shardtrain.train")

PYFUNC_CODE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mlflow_pyfunc_code.py")
LOGGED_MODEL_NAME = "model"
EXAMPLE_ROWS = 5
REQUIREMENTS = ("torch", "numpy", "pandas", "pyarrow", "safetensors", "fsspec", "pyyaml", "pillow")  # pillow: images
# The pyfunc's model_config from now on: refused rows marked (module docstring). A model logged
# before has none, and predicts as load_model's predict does by default.
# trust_code is there (False) because MLflow overrides only the keys a model was logged with:
# mlflow.pyfunc.load_model(uri, model_config={"trust_code": True}) must find it to set it.
MODEL_CONFIG = {"errors": "mark", "trust_code": False}


class ShardtrainPyfunc(mlflow.pyfunc.PythonModel):
    """A published shardtrain model as an MLflow pyfunc: raw feature columns in, predictions out."""

    def load_context(self, context):
        from training.export import load_model

        config = getattr(context, "model_config", None) or {}
        # Verified here, file by file, against model.json's sha256s and the marker's model.json sha256.
        # A model trained from code given to train() runs that code only where the loader asks:
        # mlflow.pyfunc.load_model(uri, model_config={"trust_code": True}) (never a logged default).
        self.model = load_model(context.artifacts[ARTIFACT_KEY], trust_code=bool(config.get("trust_code", False)))
        # MODEL_CONFIG's errors="mark"; a model logged before has no model_config, and keeps
        # predict's default (its signature's tensor output) with it.
        self.errors = config.get("errors", "raise")

    # The type hint says what MLflow passes (it infers no schema from it: the signature is ours).
    def predict(self, context, model_input: pd.DataFrame, params=None):
        return self.model.predict(model_input, errors=self.errors)


def signature(meta: dict):
    """The model's MLflow signature: every raw feature column (module docstring) -> ``output_schema``."""
    from mlflow.models.signature import ModelSignature
    from mlflow.types import Schema

    inputs = [column for kind in FeatureSpec(meta["features"]).kinds for column in kind.signature_columns()]
    return ModelSignature(inputs=Schema(inputs), outputs=output_schema(LabelSpec.from_record(meta["label"])))


def output_schema(label: LabelSpec):
    """What ``predict(frame, errors="mark")`` returns: the probabilities (classification; and the
    predicted class's name where the label names its classes) or the value (regression), null for
    a refused row, and its ``score_reason``."""
    from mlflow.types import ColSpec, DataType, Schema
    from mlflow.types.schema import Array

    if not label.classification:
        outputs = [ColSpec(DataType.float, PREDICTION, required=False)]
    else:
        outputs = [ColSpec(Array(DataType.float), PROBABILITIES, required=False)]
        name = DataType.string if label.classes is not None else DataType.long
        if label_task(label.task).multi:  # the classes at or above the threshold
            outputs.append(ColSpec(Array(name), PREDICTION, required=False))
        elif label.classes is not None:
            outputs.append(ColSpec(name, PREDICTION, required=False))
    return Schema([*outputs, ColSpec(DataType.string, REASON, required=False)])


def input_example(meta: dict, dataset_uri: str, splits: list[str], rows: int = EXAMPLE_ROWS):
    """The first ``rows`` rows of the first of ``splits`` the dataset has, as raw columns (pandas)."""
    import pyarrow.parquet as pq

    manifest = read_manifest(dataset_uri)
    split = next(s for s in splits if s in manifest.split_names)
    entry = manifest.files(split)[0]
    with manifest.root.open(entry.path, "rb") as fh:
        table = pq.ParquetFile(fh).read_row_group(0).slice(0, rows)
    spec = FeatureSpec(meta["features"])
    spec.attach(manifest.root)  # a text feature decodes its ids with the dataset's tokenizer
    columns = {name: spec.kind_of(name).raw_example(name, table.column(name)) for name in spec.columns}
    return pd.DataFrame(columns)[spec.columns]


def pip_requirements() -> list[str]:
    """What loading and predicting need, pinned to the versions here (a local build tag dropped)."""
    from importlib.metadata import PackageNotFoundError, version

    found = [f"shardtrain=={__version__}"]
    for name in REQUIREMENTS:
        try:
            found.append(f"{name}=={version(name).split('+')[0]}")
        except PackageNotFoundError:
            found.append(name)
    return found


def log_and_register(cfg, run_id: str, model_dir: str, meta: dict, dataset_uri: str, splits: list[str]) -> dict:
    """Log the published model at local ``model_dir`` as the run's pyfunc model; register it as a
    new version of ``cfg.registered_model`` (and move ``cfg.alias`` to it) when set. Returns what
    happened: {"model_uri", "version"}. A registry failure warns naming the model and the registry
    (the logged model stays); any other failure is raised (tracking's caller warns)."""
    import mlflow

    example = input_example(meta, dataset_uri, splits)
    with mlflow_uris(cfg.tracking_uri):
        with mlflow.start_run(run_id=run_id):
            info = mlflow.pyfunc.log_model(
                name=LOGGED_MODEL_NAME, python_model=PYFUNC_CODE, artifacts={ARTIFACT_KEY: model_dir},
                signature=signature(meta), input_example=example, pip_requirements=pip_requirements(),
                model_config=MODEL_CONFIG)
        # Inside the scope too: a registry finds the logged model (models:/m-...) through the tracking URI.
        version = register_or_warn(cfg, info, run_id) if cfg.registered_model else None
    return {"model_uri": info.model_uri, "version": version}


def register_or_warn(cfg, info, run_id: str) -> str | None:
    """A new version of ``cfg.registered_model`` from the logged model, ``cfg.alias`` moved to it;
    None after one warning naming the model and the registry."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=cfg.tracking_uri, registry_uri=cfg.registry_uri)
    registry = client._registry_uri
    try:
        check_reachable(registry, "the model registry")
        with contextlib.suppress(Exception):  # already there: RESOURCE_ALREADY_EXISTS (the usual case)
            client.create_registered_model(cfg.registered_model)
        version = client.create_model_version(cfg.registered_model, source=info.model_uri, run_id=run_id,
                                              model_id=info.model_id).version
        if cfg.alias:
            client.set_registered_model_alias(cfg.registered_model, cfg.alias, str(version))
    except Exception as exc:  # noqa: BLE001 - the registry must not fail training either
        log.warning("MLflow model registry: registering the model as %s in %s failed, the training run is unaffected "
                    "(its model is logged with the MLflow run): %s", cfg.registered_model, registry,
                    f"{type(exc).__name__}: {first_line(exc)}")
        return None
    log.info("registered %s version %s in %s%s", cfg.registered_model, version, registry,
             f"; alias {cfg.alias} -> version {version}" if cfg.alias else "")
    return str(version)


__all__ = ["MODEL_CONFIG", "ShardtrainPyfunc", "input_example", "log_and_register", "output_schema",
           "pip_requirements", "register_or_warn", "signature"]
