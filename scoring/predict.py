"""The scoring core: a published model run over a Spark DataFrame, exactly like ``load_model(uri).predict``.

    predict_frame(df, model_uri, *, batch_size=1024, temperature=1.0, keep_columns=None,
                  encoded=False, program=False) -> DataFrame

The result has one row per input row (none dropped, none added), with these columns in order:

* ``keep_columns`` of ``df``, unchanged (default: every column of ``df``);
* classification: ``probabilities`` array<float> (softmax(logits / temperature), one entry per
  class) and ``prediction``, the most probable class: bigint where the labels are the integers
  ``[0, num_classes)`` (the class index is the label's own value), string where the label names
  its classes (``label.classes``: the class's name; the probabilities are in the names' order);
* multilabel: ``probabilities`` array<float> (each class's sigmoid(logit / temperature)) and
  ``prediction``, the classes at or above the label's threshold: array<string> of names, or
  array<bigint> of indices where the label does not name them;
* regression: ``prediction`` float (the model's value; ``temperature`` does not apply);
* ``score_reason`` string: null for a scored row; for a row the model's preprocessing cannot take,
  the reason (its predictions are null): ``bad_encoding`` (a string feature holding U+FFFD, what
  Spark reads bytes that are not UTF-8 as), ``bad_value:<col>`` (a string that is not a number),
  ``non_finite:<col>`` (NaN, +/-inf or beyond float32 in a numeric column; a null, NaN, inf or
  beyond-float32 element of an array), ``too_long:<col>`` (a category longer than the shard
  job's features.max_category_bytes, as the model records it), ``bad_shape:<col>`` (a null
  array, or one of another length than the model's shape). These are the shard job's own rules
  (``common.rows``), which ``LoadedModel.predict`` applies to pandas and Arrow frames too, so a
  row training would have quarantined is scored nowhere.

What runs per row is the model's stored preprocessing, ``FeatureSpec.transform`` (the code
``LoadedModel.predict`` runs), after the shard job's own typing in Spark SQL: numeric columns cast
to double (null counts as missing and is imputed), categorical ones cast to string, array elements
to float. ``encoded=True`` takes the stored encodings of a published dataset instead (standardized
float32, int32 category indices, flat float32 arrays: what ``FeatureSpec.transform`` produced)
and runs ``LoadedModel.predict_arrays`` on them without preprocessing them again; the caller must
check that the dataset's feature spec is the model's (``scoring.job`` does).

Driver/executor split: the driver loads the model once to check it and the input's columns, then
ships only plain values (``ScoreTask``). A registered model (``models:/``) is resolved to one
version on the driver; the workers read that version where its artifacts lie when the artifact
store is a file system (``RegistryModel.location``: no MLflow import, registry lookup or download
in any worker), else download that pinned version. Each Python worker loads the model once, on first use,
and keeps it for every later batch and task (``_MODELS``), on the GPU Spark assigned to its task
(``scoring_device``: training's rule, CUDA_VISIBLE_DEVICES included), else CUDA's current device
or the CPU.
The model's weights digest travels with the task: a worker that finds another model at the URI
(replaced while the job ran) fails rather than mixing two models' predictions.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
from dataclasses import dataclass

import numpy as np

from common.errors import DatasetError, InputDataError
from common import rows
from common.devices import resolve_device
from common.model_artifact import PREDICTION, PROBABILITIES, REASON
from common.sql import quote_identifier as q
from common.tasks import label_task

log = logging.getLogger("shardtrain.score")

OUTPUT_COLUMNS = (PROBABILITIES, PREDICTION, REASON)
DEFAULT_BATCH_SIZE = 1024
_FEATURE = "__score_feature_{}"  # private names of the typed feature columns inside the job
# ... and of the kept columns: pyspark's mapInArrow looks its input columns up by name, which a
# name with a backtick or a dot does not survive; they get their own names back after it.
_KEPT = "__score_kept_{}"


@dataclass(frozen=True)
class ScoreTask:
    """Everything a Python worker needs, as plain picklable values (no session, no model)."""

    model_uri: str
    program: bool
    weights_sha256: str
    task: str  # the label's task (common.tasks)
    num_classes: int
    keep_columns: tuple[str, ...]  # the kept columns' private names (_KEPT)
    features: tuple[tuple[str, str], ...]  # (feature name, private column name) in FeatureSpec order
    encoded: bool
    temperature: float
    batch_size: int
    # A registered model the workers download (models:/NAME/VERSION, pinned on the driver): the
    # registry it is in. None for a path, including a registered version's artifacts on a file system.
    registry_uri: str | None = None
    classes: tuple[str, ...] | None = None  # the label's class names, where it names them (``prediction``)
    trust_code: bool = False  # run the code a model trained from train(model=...) holds (load_model's)
    threshold: float = 0.5  # multilabel: a class is predicted at or above this probability


def predict_frame(df, model_uri: str, *, batch_size: int = DEFAULT_BATCH_SIZE, temperature: float = 1.0,
                  keep_columns: list[str] | None = None, encoded: bool = False, program: bool = False,
                  fingerprint: str | None = None, registry_uri: str | None = None, trust_code: bool = False):
    """``df`` scored with the model at ``model_uri``: see the module docstring for the columns.

    ``model_uri`` may name a registered version, ``models:/NAME/VERSION`` or ``models:/NAME@ALIAS``
    (in ``registry_uri``, or MLflow's default registry): the driver resolves it to one version
    once, and every worker loads that version (and verifies it like any model), so a moving alias
    cannot mix two models' predictions.

    ``trust_code``: a model trained from code given to train() is rebuilt by running that code,
    stored with it; only when this is True (``load_model``'s ``trust_code``).

    ``fingerprint``: the model's identity (its model.json sha256, as its commit marker records
    it) that the caller already recorded; a model at the URI with another one is refused, so a
    job never publishes one model's scores under another's fingerprint.

    Raises DatasetError (exit 2) for a model that cannot be loaded, InputDataError (exit 2) for a
    missing feature column, a column of a type the model cannot take, or a kept column that is
    missing or named like an output column; ValueError for a bad batch_size or temperature.
    Lazy: nothing runs until the result is written or collected.
    """
    _check_options(batch_size, temperature)
    model, worker_uri, worker_registry = _driver_model(model_uri, program, registry_uri, fingerprint, trust_code)
    spec = model.features
    hidden = {c for kind in spec.kinds for c in kind.prepared_columns()}
    keep = [c for c in df.columns if c not in hidden] if keep_columns is None else list(keep_columns)
    _check_keep_columns(df, keep)
    fields = {f.name: f.dataType for f in df.schema.fields}
    check_feature_types(fields, spec, encoded)
    if not encoded:
        df = prepared_frame(df, spec)
    names = spec.columns
    task = ScoreTask(
        model_uri=worker_uri, program=program, trust_code=trust_code,
        weights_sha256=model.weights_sha256,
        task=model.task, num_classes=int(model.label.num_classes or 0),
        keep_columns=tuple(_KEPT.format(i) for i in range(len(keep))),
        features=tuple((n, _FEATURE.format(i)) for i, n in enumerate(names)),
        encoded=encoded, temperature=float(temperature), batch_size=batch_size, registry_uri=worker_registry,
        classes=model.label.classes, threshold=model.label.threshold)
    prepared = _prepared(df, task, keep, fields, spec, encoded)
    schema = output_schema(df, keep, model.task, named_classes=model.label.classes is not None)
    private = [*task.keep_columns, *schema.fieldNames()[len(keep):]]
    scored = prepared.mapInArrow(_Scorer(task), _renamed(schema, private))
    return scored.toDF(*schema.fieldNames())  # toDF renames without parsing the names


def _check_options(batch_size, temperature) -> None:
    if not (isinstance(batch_size, int) and batch_size >= 1):
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")


def _driver_model(model_uri: str, program: bool, registry_uri: str | None, fingerprint: str | None,
                  trust_code: bool = False):
    """(the model, the URI and the registry its workers load it from). The model is loaded and
    verified once, here on the driver, so a bad model fails before any task runs; a registered one
    is resolved to one version first."""
    from common.model_registry import is_registry_uri, resolve_registry_model
    from training import load_model

    # What the workers load: the path itself, or the version the driver resolved. A registered
    # version whose artifacts lie on a file system is read there (common.model_registry), so the
    # workers import no MLflow and ask no registry.
    worker_uri, worker_registry = model_uri, registry_uri
    if is_registry_uri(model_uri):
        registered = resolve_registry_model(model_uri, registry_uri)
        model_uri, registry_uri = registered.pinned_uri, registered.registry_uri
        worker_uri, worker_registry = ((registered.location, None) if registered.location is not None
                                       else (model_uri, registry_uri))
    model = load_model(model_uri, program=program, registry_uri=registry_uri, trust_code=trust_code)
    if fingerprint is not None and model.fingerprint != fingerprint:
        raise DatasetError(f"{model_uri}: the model was replaced while this job ran (its model.json sha256 is now "
                           f"{model.fingerprint[:12]}, the job recorded {fingerprint[:12]}); nothing was published: "
                           "run the job again")
    return model, worker_uri, worker_registry


def _prepared(df, task: ScoreTask, keep: list[str], fields: dict, spec, encoded: bool):
    """``df`` as the workers read it: the kept columns and the typed features under their private
    names (``task``), and each row's quarantine reason."""
    typed = [f"{expr} AS {private}" for (name, private), expr in
             zip(task.features, _typed_features(fields, spec, encoded))]
    reason = reason_sql(fields, spec, encoded)
    kept = [f"{q(c)} AS {private}" for c, private in zip(keep, task.keep_columns)]
    return df.selectExpr(*kept, *typed, f"{reason} AS {REASON}")


def _renamed(schema, names: list[str]):
    from pyspark.sql import types as T

    return T.StructType([T.StructField(n, f.dataType, f.nullable) for n, f in zip(names, schema.fields)])


def output_schema(df, keep_columns: list[str], task: str, named_classes: bool = False):
    """The result's Spark schema: the kept columns' own types, then the prediction columns (a
    class's name where the label names its classes, ``named_classes``)."""
    from pyspark.sql import types as T

    by_name = {f.name: f for f in df.schema.fields}
    fields = [by_name[c] for c in keep_columns]
    if label_task(task).classes:
        fields.append(T.StructField(PROBABILITIES, T.ArrayType(T.FloatType()), True))
        predicted = T.StringType() if named_classes else T.LongType()
        fields.append(T.StructField(PREDICTION, T.ArrayType(predicted) if label_task(task).multi else predicted, True))
    else:
        fields.append(T.StructField(PREDICTION, T.FloatType(), True))
    fields.append(T.StructField(REASON, T.StringType(), True))
    return T.StructType(fields)


def prepared_frame(df, spec):
    """``df`` with what the model's row rules read besides its raw columns, where a kind checks
    in a Python stage (an image's decode: ``FeatureKind.prepared``); ``df`` itself where none
    does, or where the stage already ran (``score`` runs it once, before counting reasons)."""
    for kind in spec.kinds:
        added = kind.prepared_columns()
        if not (added and all(c in df.columns for c in added)):
            df = kind.prepared(df, store=False)
    return df


def reason_sql(fields: dict, spec, encoded: bool = False) -> str:
    """Spark SQL giving a row's quarantine reason (the first rule it breaks), or NULL when the model
    can score it. ``fields``: column name -> Spark type; ``spec``: the model's FeatureSpec."""
    reasons = _reason_branches(fields, spec, encoded)
    return f"CASE {' '.join(reasons)} END" if reasons else "CAST(NULL AS STRING)"


# A branch ends in THEN and the reason's literal, as common.sql.quote_string writes it: quotes and
# backslashes inside are backslash-escaped, so the literal is the last run of escaped or plain
# characters between two unescaped quotes.
_THEN_LITERAL = re.compile(r" THEN '((?:[^'\\]|\\.)*)'$", re.DOTALL)


def reason_values(fields: dict, spec, encoded: bool = False) -> list[str]:
    """Every reason ``reason_sql`` can give, in its order, read off its own branches (so the two
    cannot drift): what a job counts rows by without grouping them."""
    values = []
    for branch in _reason_branches(fields, spec, encoded):
        match = _THEN_LITERAL.search(branch)
        if match is None:  # a rule built some other way: counting by reason would miss its rows
            raise AssertionError(f"quarantine rule without a literal reason: {branch}")
        value = re.sub(r"\\(.)", r"\1", match.group(1), flags=re.DOTALL)
        if value not in values:
            values.append(value)
    return values


def _reason_branches(fields: dict, spec, encoded: bool) -> list[str]:
    """The CASE branches of ``reason_sql``, first rule first: the shard job's order (common.rows)."""
    from pyspark.sql import types as T

    reasons = []
    if not encoded:
        reasons += rows.encoding_reasons([n for kind in spec.kinds if kind.text for n in kind.names
                                          if isinstance(fields[n], T.StringType)])
    return reasons + [branch for kind in spec.kinds for n in kind.names
                      for branch in kind.sql_reasons(n, fields[n], stored=encoded)]


def _typed_features(fields: dict, spec, encoded: bool) -> list[str]:
    """The shard job's typing of each feature (its kind's, as preprocess.row_columns applies it),
    in FeatureSpec order."""
    return [kind.typed_sql(n, stored=encoded) for kind in spec.kinds for n in kind.names]


def _check_keep_columns(df, keep: list[str]) -> None:
    missing = [c for c in keep if c not in df.columns]
    if missing:
        raise InputDataError(f"output.keep_columns names column(s) {missing} that the input does not have; it has "
                             f"{sorted(df.columns)}")
    clash = [c for c in keep if c in OUTPUT_COLUMNS]
    if clash:
        raise InputDataError(f"output.keep_columns: column(s) {clash} would clash with the score columns "
                             f"{list(OUTPUT_COLUMNS)}; rename them in the query")
    dup = sorted({c for c in keep if keep.count(c) > 1})
    if dup:
        raise InputDataError(f"output.keep_columns lists column(s) {dup} more than once")


def check_feature_types(fields: dict, spec, encoded: bool) -> None:
    """Every feature the model reads is there, with a type its preprocessing can take (exit 2).
    Runs before any SQL is built from the features (``reason_sql``), so the user sees the column,
    the type it has and the type wanted, never an analysis error."""
    wanted = [(n, functools.partial(kind.spark_type_ok, stored=encoded), kind.wanted(encoded))
              for kind in spec.kinds for n in kind.names]
    for name, ok, want in wanted:
        if name not in fields:
            raise InputDataError(f"the input lacks the model's feature column {name!r} ({want}); it has "
                                 f"{sorted(fields)}")
        if not ok(fields[name]):
            raise InputDataError(f"column {name!r} has type {fields[name].simpleString()}, which the model's "
                                 f"preprocessing cannot take as {want}; convert it in the query")


# --- executor side -----------------------------------------------------------------------------

_MODELS: dict = {}  # (uri, program, weights digest, device) -> LoadedModel, one per Python worker


class _Scorer:
    """The mapInArrow body; a class (not a closure) so only ``task`` is pickled."""

    def __init__(self, task: ScoreTask):
        self.task = task

    def __call__(self, batches):
        model = worker_model(self.task)
        for batch in batches:
            yield score_batch(model, self.task, batch)


def worker_model(task: ScoreTask):
    """This Python worker's copy of the model: loaded on first use, then reused by every batch and
    every later task the worker runs (Spark reuses Python workers by default)."""
    device, why = worker_device()
    key = (task.model_uri, task.program, task.weights_sha256, device)
    if key not in _MODELS:
        from training import load_model

        model = load_model(task.model_uri, program=task.program, registry_uri=task.registry_uri,
                           trust_code=task.trust_code)
        found = model.weights_sha256
        if found != task.weights_sha256:
            raise RuntimeError(f"{task.model_uri}: the model was replaced while this job ran (weights sha256 "
                               f"{found[:12]}... instead of {task.weights_sha256[:12]}...); re-run the job")
        _MODELS.clear()  # one model per worker: a long-lived worker scoring many models keeps the last
        _MODELS[key] = model.to(device)
        log.info("loaded %s on %s (%s)", task.model_uri, device, why)
    return _MODELS[key]


def worker_device() -> tuple[str, str]:
    """(device, why) for this Python worker: what ``scoring_device`` decides from the GPUs Spark
    assigned to the task (spark.task.resource.gpu.amount) and this process's CUDA."""
    import torch
    from pyspark import TaskContext

    context = TaskContext.get()
    gpus = context.resources().get("gpu") if context is not None else None
    return scoring_device(list(gpus.addresses) if gpus is not None else [], torch.cuda.is_available(),
                          os.environ.get("CUDA_VISIBLE_DEVICES"))


def scoring_device(gpu_addresses: list[str], cuda_available: bool, visible_devices: str | None) -> tuple[str, str]:
    """(torch device, why): the task's GPU by training's own rule (``common.devices``: a Spark
    address is a physical id, renumbered where CUDA_VISIBLE_DEVICES is set), else the CPU.

    One difference from a training rank, kept from before the rule was shared: a task Spark
    assigned no GPU still uses CUDA's current device when there is one (local mode on a GPU host,
    no GPU resource configured), where a rank takes the CPU."""
    if not gpu_addresses and cuda_available:
        return "cuda", "no GPU assigned to this task by Spark; CUDA's current device"
    return resolve_device(gpu_addresses, cuda_available, visible_devices)


def score_batch(model, task: ScoreTask, batch):
    """One Arrow batch (spark.sql.execution.arrow.maxRecordsPerBatch rows) -> the output batch: kept
    columns, predictions for the clean rows, reasons. The batch is preprocessed at once, column by
    column on its Arrow arrays (no pandas conversion), then run through the network
    ``task.batch_size`` rows at a time."""
    import pyarrow as pa

    reason = batch.column(batch.schema.get_field_index(REASON))
    ok = reason.is_null().to_numpy(zero_copy_only=False).astype(bool)
    clean = batch.filter(pa.array(ok)) if not ok.all() else batch
    n_clean = clean.num_rows
    if n_clean:
        features = pa.table({name: clean.column(clean.schema.get_field_index(private))
                             for name, private in task.features})
        arrays = _encoded_arrays(features, model.features) if task.encoded else model.features.transform(features)
        step = task.batch_size
        values = np.concatenate([model.predict_arrays({k: v[i:i + step] for k, v in arrays.items()}, task.temperature)
                                 for i in range(0, n_clean, step)])
    else:
        values = np.zeros((0, *label_task(task.task).output_shape(task.num_classes)), dtype=np.float32)
    columns = [batch.column(batch.schema.get_field_index(c)) for c in task.keep_columns]
    names = list(task.keep_columns)
    if label_task(task.task).classes:
        predicted = _predicted_set if label_task(task.task).multi else _predicted_class
        columns += [_scatter_lists(values, ok, task.num_classes), predicted(values, ok, task)]
        names += [PROBABILITIES, PREDICTION]
    else:
        columns.append(_scatter(values, ok, pa.float32()))
        names.append(PREDICTION)
    columns.append(reason.cast(pa.string()))
    names.append(REASON)
    return pa.RecordBatch.from_arrays(columns, names=names)


def _scatter(values: np.ndarray, ok: np.ndarray, dtype):
    """Values of the clean rows into a column of every row, null where the row was not scored."""
    import pyarrow as pa

    full = np.zeros(len(ok), dtype=dtype.to_pandas_dtype())
    full[ok] = values
    return pa.array(full, type=dtype, mask=~ok)


def _predicted_class(values: np.ndarray, ok: np.ndarray, task: ScoreTask):
    """The most probable class of each scored row: its index, or its name where the label names
    its classes; null where the row was not scored."""
    import pyarrow as pa

    index = _scatter(values.argmax(axis=1), ok, pa.int64())
    return index if task.classes is None else pa.array(list(task.classes), type=pa.string()).take(index)


def _predicted_set(values: np.ndarray, ok: np.ndarray, task: ScoreTask):
    """A multilabel row's classes at or above the threshold, a list of names (or indices) per
    scored row; null where the row was not scored."""
    import pyarrow as pa

    rows, classes = np.nonzero(values >= task.threshold)  # row-major: each row's classes in class order
    offsets = np.zeros(len(ok) + 1, dtype=np.int32)
    offsets[1:][ok] = np.bincount(rows, minlength=len(values))
    offsets = np.cumsum(offsets, dtype=np.int32)
    indices = pa.array(classes.astype(np.int64), type=pa.int64())
    flat = indices if task.classes is None else pa.array(list(task.classes), type=pa.string()).take(indices)
    return pa.ListArray.from_arrays(pa.array(offsets), flat, mask=pa.array(~ok))


def _scatter_lists(values: np.ndarray, ok: np.ndarray, width: int):
    """[n_clean, width] probabilities -> a list<float> column of every row (null where not scored)."""
    import pyarrow as pa

    offsets = np.zeros(len(ok) + 1, dtype=np.int32)
    offsets[1:] = np.cumsum(np.where(ok, width, 0))
    flat = pa.array(np.ascontiguousarray(values, dtype=np.float32).ravel(), type=pa.float32())
    return pa.ListArray.from_arrays(pa.array(offsets), flat, mask=pa.array(~ok))


def _encoded_arrays(table, spec) -> dict:
    """A dataset's stored encodings, stacked the way the network takes them (no preprocessing)."""
    out = {}
    for kind in spec.kinds:
        out.update(kind.stored_batch(table, table.num_rows))
    return out


__all__ = ["OUTPUT_COLUMNS", "PREDICTION", "PROBABILITIES", "REASON", "ScoreTask", "check_feature_types", "output_schema",
           "predict_frame", "prepared_frame",
           "reason_sql", "reason_values", "score_batch", "scoring_device", "worker_model"]
