"""The shard job's ``teacher`` option: a published model's soft targets, stored as the ``teacher``
column of every split, for knowledge distillation (``train.distill``).

The teacher runs once, by Spark, over the checked rows (in the staging pass, before encoding):
it reads the raw feature columns and applies the preprocessing stored with it, exactly as
``load_model(uri).predict`` does. Its outputs ride along to the shard writer like any other
column, so balance, accounting and the atomic publish are the shard job's as always. The
teacher must read the dataset's own features and predict its classes (refused here, before any
work, naming what differs): then the shard job's row rules are the teacher's, and every clean
row can be scored.

Byte-identical re-runs: a batched matmul's last bits depend on the batch a row is computed in
(measured with torch on CPU: rows scored in batches of under 64 rows differ in the last bit from
the same rows scored in larger batches), and Spark's input partitions, hence the scorer's batches,
change with the cluster and the input files. So the rows are scored where the shard job has
arranged them by their content alone: in its staging pass, whose partitions are a split's range
of buckets of the shuffle key, sorted within each by the shuffle key. Every row then meets the same batch on any cluster, and the teacher column is
bit-identical across re-runs given the same hardware kind, torch build and
``spark.sql.execution.arrow.maxRecordsPerBatch`` (another CPU or GPU kernel may change last bits).

pipelines never imports ``scoring`` or ``training`` (data and imports flow one way): the
shardtrain layer builds a ``TeacherScorer`` from scoring's Spark function (shardtrain/teacher.py)
and hands it to ``run_shard_job``. This module owns what the shard job does with it: the
teacher's manifest record (checked against the label before any work), and the one step that
adds the column.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from common.dataset import LABEL_NAME, TEACHER_COLUMN, LabelSpec, TeacherRecord, teacher_differences
from common.errors import ConfigError, InputDataError
from common.sql import quote_identifier as q
from common.tasks import label_task
from pipelines.preprocess import configured_features, typed_features
from pipelines.shard_config import ShardConfig


@dataclass(frozen=True)
class TeacherScorer:
    """What the shard job needs from a teacher model (built by the shardtrain layer).

    ``describe(model_uri, trust_code)``: the model's identity and contract, without Spark: a dict with
    ``fingerprint`` (changes whenever the model does), ``task``, ``num_classes`` (classification;
    ``classes`` too where its label names them) and ``features`` (``FeatureSpec.teacher_features``: each raw column it reads, with its kind
    and what its kind says a reader must match).

    ``score(rows, model_uri, temperature, fingerprint, trust_code)``: the Spark DataFrame ``rows`` with a
    ``teacher`` column added (lazily): array<float> of class probabilities at ``temperature``, or
    the float value (regression), for every row, in the partitions ``rows`` has (no shuffle of its
    own); it refuses a model whose fingerprint is no longer ``fingerprint`` (the one ``describe``
    gave and the manifest records). ``trust_code``: a model trained from code given to
    ``train(model=...)`` runs that code (``teacher.model_code: trust``).
    """

    describe: Callable[[str], dict]
    score: Callable


def teacher_record(cfg: ShardConfig, scorer: TeacherScorer | None) -> TeacherRecord | None:
    """The manifest's ``teacher`` record (None without ``cfg.teacher``); reads only the model's
    description, and refuses a teacher whose outputs cannot be this dataset's soft targets
    (``check_teacher``; with ``label.classes: auto``, the shard job checks once it fitted them)."""
    if cfg.teacher is None:
        return None
    if scorer is None:
        raise ConfigError("teacher is set, but this shard job was started without a teacher scorer: run it with "
                          "`shardtrain shard`, `shardtrain run` or `shardtrain distill` (or, from Python, pass "
                          "teacher_scorer=shardtrain.teacher.teacher_scorer())")
    info = scorer.describe(cfg.teacher.model, trust_code=cfg.teacher.model_code == "trust")
    record = TeacherRecord.from_record({
        "uri": cfg.teacher.model, "fingerprint": info["fingerprint"],
        "temperature": float(cfg.teacher.temperature), "column": TEACHER_COLUMN, "task": info["task"],
        **({"num_classes": info["num_classes"]} if label_task(info["task"]).classes else {}),
        **({"classes": info["classes"]} if info.get("classes") is not None else {}),
        "features": info["features"]})
    if cfg.label.classes != "auto":
        check_teacher(record, cfg)
    return record


def check_teacher(record: TeacherRecord, cfg: ShardConfig) -> None:
    """A teacher must read this dataset's features and predict its label: the same task and
    classes (their number, and their names in the same order where either names them)."""
    differences = teacher_differences(record, _dataset_features(cfg), _dataset_label(cfg))
    if differences:
        raise InputDataError(f"teacher.model {record.uri} does not fit this dataset: its {'; its '.join(differences)}. "
                             "Its outputs would be soft targets for another problem; use a teacher trained on these "
                             "features (features.*) and this label")


def _dataset_features(cfg: ShardConfig) -> dict:
    return configured_features(cfg).spec


def _dataset_label(cfg: ShardConfig) -> LabelSpec:
    classes = cfg.label.classes  # a list: fitted by now where it was auto
    return LabelSpec(name=LABEL_NAME, task=cfg.label.task, num_classes=cfg.label.num_classes,
                     classes=None if classes is None else tuple(classes))


def with_teacher(rows, cfg: ShardConfig, scorer: TeacherScorer | None, record: TeacherRecord | None):
    """The staging pass's rows plus the ``teacher`` column (unchanged without ``cfg.teacher``):
    each partition's clean rows are sorted by content and scored there by the model ``record``
    (``teacher_record``) describes; bad rows get a null (they are never stored in a shard).

    ``rows`` must already be partitioned by content (the shard job's staging keys: a split's
    bucket range, or the bad rows), so the scorer's batches depend on the rows alone (see the
    module docstring)."""
    if cfg.teacher is None:
        return rows
    # Rows equal in both keys are identical rows (shard_writer._placed_rows), so their order cannot matter.
    clean = rows.where("_reason IS NULL").sortWithinPartitions("_shuffle", "_tiebreak")
    # The checked rows carry the typed copies of the features (numbers as doubles, categories as strings,
    # array elements as floats: the typing scoring applies too), not the raw columns: the teacher
    # reads them under the feature names, and they leave again after scoring.
    inputs = _feature_inputs(cfg, clean.columns)
    scored = scorer.score(clean.selectExpr("*", *inputs.values()), cfg.teacher.model, cfg.teacher.temperature,
                          record.fingerprint, trust_code=cfg.teacher.model_code == "trust").drop(*inputs)
    return scored.unionByName(rows.where("_reason IS NOT NULL"), allowMissingColumns=True)


def _feature_inputs(cfg: ShardConfig, present: list[str]) -> dict[str, str]:
    """Feature name -> select expression naming its typed copy as the feature (only features the
    rows do not already carry under their own name)."""
    typed = dict(typed_features(cfg))
    return {name: f"{q(col)} AS {q(name)}" for name, col in typed.items() if name not in present}


__all__ = ["TeacherScorer", "check_teacher", "teacher_record", "with_teacher"]
