"""The label in the shard job: its row rules and stored value as Spark SQL, the class list of a
label whose values name classes (``label.classes``), and the manifest's label record.

What a task's label is (a class index or a value, its stored type) is its ``common.tasks.LabelTask``;
this module turns that into the job's SQL and never compares a task's name. The rules, and where
they stand in the row's CASE (``pipelines.preprocess.row_columns``, a row gets the first reason
it breaks):

* before the features' rules: ``null_label`` (not with ``label.unlabeled: transfer``: such a row
  keeps a null label and joins the train split), then ``invalid_label``: a class index that is
  not an integer in [0, num_classes), a value that is not finite as float32;
* after them: ``unknown_class`` (``common.tasks.UNKNOWN_CLASS``), a class name outside the class
  list. Last, because ``classes: auto`` fits the list on the train rows that pass every other
  rule: a train row whose only fault is elsewhere is quarantined for that fault, and its class is
  not one the list lacks.

Named classes: the label's value is a class name, its string form (Spark's ``CAST(... AS
STRING)``, as a categorical feature's: the number 1 is "1", true is "true"), stored as its index
in the list (int64, so the loader, the losses and the class counts are those of indices). An
explicit list is the config's; ``classes: auto`` is fitted on the train split before pass one
(``fit_classes``: one Spark aggregation over the checked rows, ranked as a categorical
vocabulary is, ``common.features.categorical.spark_top_values``), so that pass one's reasons,
counts and placement already know every unknown class of val and test. The manifest's label
record then holds ``classes`` beside ``num_classes``.

A label of several classes per row (its task's ``multi``: ``task: multilabel``) is a list column
(an array of names, or of indices); a null element is ``invalid_label``, as is an index outside
[0, num_classes); any name outside the list makes the row ``unknown_class``; an empty list is a
row of no class. It is stored as a multi-hot float32 vector of num_classes; the class counts are
each class's train rows, and the record adds ``train_rows`` (the labelled train rows) and the
``threshold`` serving and the metrics predict a class at.
"""

from __future__ import annotations

import dataclasses
import math

from common.dataset import LABEL_NAME
from common.errors import ConfigError, InputDataError
from common.rows import FLOAT_MAX
from common.sql import quote_string
from common.tasks import DEFAULT_THRESHOLD, MAX_CLASSES, UNKNOWN_CLASS
from pipelines.shard_config import LabelConfig, ShardConfig

LABEL_COLUMN = "_label"  # the checked rows' typed label: what the summary counts and the writer stores


@dataclasses.dataclass(frozen=True)
class LabelSQL:
    """The label's part of the checked rows: CASE branches before and after the features' rules,
    and the select expression of its typed column (``LABEL_COLUMN``)."""
    first: list[str]
    typed: str
    last: list[str]


def label_sql(label: LabelConfig, raw: str) -> LabelSQL:
    """The label's rules and typed column for a raw label expression ``raw``. A config whose
    classes are still to be fitted (``classes: auto``) gives the name unchecked, as a string:
    what ``fit_classes`` ranks."""
    transfer = label.unlabeled == "transfer"
    first = [] if transfer else [f"WHEN {raw} IS NULL THEN 'null_label'"]
    if label.multi:
        return _label_set_sql(label, raw, first)
    if label.classes is not None:
        name = f"CAST({raw} AS STRING)"
        if label.classes == "auto":
            return LabelSQL(first, name, [])
        position = f"array_position(array({', '.join(map(quote_string, label.classes))}), {name})"
        # array_position is 0 for a name outside the list and null for a null one (a transfer row's).
        return LabelSQL(first, f"CAST({position} - 1 AS BIGINT)",
                        [f"WHEN {position} = 0 THEN {quote_string(UNKNOWN_CLASS)}"])
    number = f"try_cast({raw} AS DOUBLE)"
    if label.classification:
        invalid = _invalid_index(number, label.num_classes)
        # try_cast: the checked rows are persisted whole, bad rows too, so an invalid label (NaN,
        # huge) must not fail the cast under ANSI mode (Spark 4); valid labels cast the same.
        typed = f"try_cast({number} AS BIGINT)"
    else:
        invalid = f"{number} IS NULL OR isnan({number}) OR abs({number}) > {FLOAT_MAX!r}"
        typed = f"CAST({number} AS FLOAT)"
    # A transfer row's label stays null here (left out of class counts and moments); the shard
    # writer stores the task's missing_label (common.tasks) in its place.
    first.append(f"WHEN {raw} IS NOT NULL AND ({invalid}) THEN 'invalid_label'" if transfer
                 else f"WHEN {invalid} THEN 'invalid_label'")
    return LabelSQL(first, typed, [])


def label_type_ok(label: LabelConfig, dtype) -> bool:
    """Whether a raw label of Spark type ``dtype`` can be this label: a scalar (a number, a
    boolean or text), or for a multilabel label a list of them."""
    from pyspark.sql import types as T

    scalar = (T.NumericType, T.BooleanType, T.StringType)
    if label.multi:
        return isinstance(dtype, T.ArrayType) and isinstance(dtype.elementType, scalar)
    return isinstance(dtype, scalar)


def label_wanted(label: LabelConfig) -> str:
    """What the raw label must be, in words (``label_type_ok``)."""
    if label.multi:
        return "a list of class names" if label.classes is not None else "a list of class indices"
    return "a class name" if label.classes is not None else "a number"


def _invalid_index(number: str, num_classes: int) -> str:
    """``number`` (a double) is no class index: null, NaN, infinite, fractional, outside [0, num_classes)."""
    return (f"{number} IS NULL OR isnan({number}) OR abs({number}) = double('Infinity') "
            f"OR {number} <> floor({number}) OR {number} < 0 OR {number} >= {num_classes}")


def _label_set_sql(label: LabelConfig, raw: str, first: list[str]) -> LabelSQL:
    """A multilabel row's classes (a list of names or indices) as the multi-hot float32 vector."""
    if label.classes is not None:
        first.append(f"WHEN exists({raw}, e -> e IS NULL) THEN 'invalid_label'")
        if label.classes == "auto":
            return LabelSQL(first, f"transform({raw}, e -> CAST(e AS STRING))", [])
        position = f"array_position(array({', '.join(map(quote_string, label.classes))}), CAST(e AS STRING))"
        indices = f"transform({raw}, e -> {position} - 1)"
        last = [f"WHEN exists({raw}, e -> {position} = 0) THEN {quote_string(UNKNOWN_CLASS)}"]
    else:
        number = "try_cast(e AS DOUBLE)"
        first.append(f"WHEN exists({raw}, e -> {_invalid_index(number, label.num_classes)}) THEN 'invalid_label'")
        indices = f"transform({raw}, e -> CAST({number} AS BIGINT))"
        last = []
    classes = f"sequence(CAST(0 AS BIGINT), CAST({label.num_classes - 1} AS BIGINT))"
    hot = f"transform({classes}, i -> CAST(IF(array_contains({indices}, i), 1, 0) AS FLOAT))"
    return LabelSQL(first, f"CASE WHEN {raw} IS NOT NULL THEN {hot} END", last)


def fit_classes(checked, cfg: ShardConfig) -> ShardConfig:
    """``cfg`` (``label.classes: auto``) with the class list of the train split's clean rows
    (``checked``: the rows as ``row_columns`` gives them for ``cfg``), most frequent first, ties by
    name, as ``label.classes`` and their number as ``label.num_classes``. Refuses a list of fewer than 2 or more than
    MAX_CLASSES classes (exit 2), and one that ``label.num_classes``, when set, does not count."""
    from common.features.categorical import spark_top_values

    label = cfg.label
    train = list(cfg.split.fractions).index("train")
    clean = checked.where(f"_split = {train} AND _reason IS NULL")
    if label.multi:  # each class of a row's list
        clean = clean.selectExpr(f"explode({LABEL_COLUMN}) AS {LABEL_COLUMN}")
    classes = spark_top_values(clean, {LABEL_NAME: LABEL_COLUMN}, 1, MAX_CLASSES + 1)[LABEL_NAME]
    if not 2 <= len(classes) <= MAX_CLASSES:
        raise InputDataError(f"label.classes is auto, and the train split's clean rows hold "
                             f"{'more than ' if len(classes) > MAX_CLASSES else ''}{min(len(classes), MAX_CLASSES):,} "
                             f"class(es) {classes[:5] if len(classes) <= 5 else ''}; a class label needs 2 to "
                             f"{MAX_CLASSES:,} (is label.column the label?)")
    if label.num_classes is not None and label.num_classes != len(classes):
        raise ConfigError(f"label.num_classes is {label.num_classes}, but label.classes: auto found {len(classes)} "
                          f"classes on the train split ({_shown(classes)}); remove label.num_classes (it follows "
                          "from the classes), or list them in label.classes")
    return dataclasses.replace(cfg, label=dataclasses.replace(label, classes=classes, num_classes=len(classes)))


def _shown(classes: list[str]) -> str:
    return repr(classes) if len(classes) <= 10 else f"{classes[:10]!r}[:10]"


def label_record(label: LabelConfig, class_counts: list[int], moments: tuple[int, float, float] | None,
                 label_rows: int) -> dict:
    """The manifest's label entry: class counts (and the class names, where the values name
    them) for a class label, mean and std for a value; a multilabel label's threshold and
    labelled train rows (``label_rows``)."""
    record = {"name": LABEL_NAME, "task": label.task, "source": label.column or label.expr}
    if label.classification:
        record["num_classes"] = label.num_classes
        if label.classes is not None:
            record["classes"] = list(label.classes)
        if label.multi:
            record["threshold"] = DEFAULT_THRESHOLD if label.threshold is None else label.threshold
            record["train_rows"] = label_rows
        record["train_class_counts"] = class_counts
    else:
        count, mean, m2 = moments
        record.update(train_mean=mean if count else 0.0, train_std=math.sqrt(m2 / count) if count else 0.0)
    return record


__all__ = ["LABEL_COLUMN", "LabelSQL", "fit_classes", "label_record", "label_sql", "label_type_ok", "label_wanted"]
