"""The shard job's row checks and fitted preprocessing, as Spark SQL expressions built on the driver.

Three steps, each a function of the config (and, for the last, of fitted statistics):

1. ``check_table``: every declared column exists and has a type we can cast; fails before any
   data is read, naming the column, its config key and the source.
2. ``row_columns``: per-row SQL for the split, the shuffle key, the typed values and the
   quarantine ``_reason`` (the first rule a row breaks, in a fixed order).
3. ``fit``: the statistics and vocabularies from the train split's summary
   (pipelines/summary.py: exact moments, value counts, class counts), and each feature's share of
   nulls there (``null_share``); the stored encodings are ``common.dataset.FeatureSpec``'s,
   applied by the shard writer (pipelines/shard_writer.py).

Reasons: ``bad_encoding`` (a used text value holds U+FFFD, which Spark's CSV/JSON readers put in
place of bytes that are not valid UTF-8), ``null_label`` (none with ``label.unlabeled: transfer``:
those rows join the train split as transfer rows), ``invalid_label``,
``too_long:<col>`` (a category longer than features.max_category_bytes),
``bad_value:<col>`` (a string that is not a number),
``non_finite:<col>`` (a numeric value that is NaN, +/-inf or beyond float32, as stored; a
null, NaN, inf or beyond-float32 element of an array), ``bad_shape:<col>`` (null array or wrong
length), and ``malformed_record`` (common/sources.py). A null numeric value is missing and is
imputed. The rules of a feature's raw value (text, numeric, categorical, array) are
``common.rows``, which scoring and a loaded model's ``predict`` apply too, so neither a statistic
nor a prediction ever sees a value float32 cannot hold or a category the shard job refused; this
module owns the label's rules and where they stand among those, and must not define a feature
rule of its own that scoring would not apply.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from pipelines.balance import split_index_sql
from common.errors import InputDataError, first_line
from common.rows import (FLOAT_MAX, array_reasons, array_value, category_reasons, encoding_reasons, numeric_reasons,
                         numeric_value)
from common.sql import quote_identifier as q
from common.dataset import LABEL_NAME, NULL_SHARE, RESERVED_INDICES, ROW_INDEX, TeacherRecord
from common.dataset import stored_schema as dataset_schema
from pipelines.shard_config import ShardConfig
from pipelines.summary import Summary, top_values

RESERVED_NAMES = {LABEL_NAME, ROW_INDEX}


# The typed copies of the features, by column name (Arrow tables, dict keys); SQL text names them
# through q(), like every other column: a feature may be called "price-usd" or "first name". The
# name itself is escaped where Spark's DataFrame API would parse it (a backtick, a dot: pyspark's
# mapInArrow looks its input columns up by name), so the staging pass can take any feature name.

def _typed_name(prefix: str, name: str) -> str:
    return prefix + name.replace("%", "%25").replace("`", "%60").replace(".", "%2E")


def num_col(name: str) -> str:
    return _typed_name("_n_", name)


def cat_col(name: str) -> str:
    return _typed_name("_c_", name)


def arr_col(name: str) -> str:
    return _typed_name("_a_", name)


def typed_features(cfg: ShardConfig) -> tuple[tuple[str, str], ...]:
    """(feature name, typed column) of every feature: the columns whose nulls on train the
    summary counts (``fit``'s null shares)."""
    feats = cfg.features
    return (*((n, num_col(n)) for n in feats.numeric), *((n, cat_col(n)) for n in feats.categorical),
            *((n, arr_col(n)) for n in feats.arrays))


def check_table(table, cfg: ShardConfig, where: str) -> None:
    """Missing columns and uncastable types fail here, before anything is read or written."""
    from pyspark.sql import types as T

    fields = {f.name: f.dataType for f in table.schema.fields}
    feats = cfg.features
    clash = sorted(RESERVED_NAMES & set(feats.all_columns))
    if clash:
        raise InputDataError(f"feature column(s) {clash} use a name the dataset reserves ({sorted(RESERVED_NAMES)}); "
                             f"rename them in the query")
    wanted = [(c, "features.numeric") for c in feats.numeric] + [(c, "features.categorical") for c in feats.categorical]
    wanted += [(c, f"features.arrays.{c}") for c in feats.arrays]
    if cfg.label.column is not None:
        wanted.append((cfg.label.column, "label.column"))
    for column, key in wanted:
        if column not in fields:
            raise InputDataError(f"column {column!r} ({key}) is not in {where}; it has columns {sorted(fields)}")

    scalar = (T.NumericType, T.BooleanType, T.StringType)
    for column in feats.numeric:
        _require_type(isinstance(fields[column], scalar), column, "features.numeric", fields[column], "float", where)
    for column in feats.categorical:
        ok = isinstance(fields[column], T.AtomicType) and not isinstance(fields[column], T.BinaryType)
        _require_type(ok, column, "features.categorical", fields[column], "a category (string)", where)
    for column in feats.arrays:
        dt = fields[column]
        ok = isinstance(dt, T.ArrayType) and isinstance(dt.elementType, (T.NumericType, T.BooleanType))
        _require_type(ok, column, f"features.arrays.{column}", dt, "array<float>", where)
    if cfg.label.column is not None:
        _require_type(isinstance(fields[cfg.label.column], scalar), cfg.label.column, "label.column",
                      fields[cfg.label.column], "a number", where)

    # Expressions (label.expr, split.key) must analyse against the table.
    for key, expr in (("split.key", cfg.split.key), ("label.expr", cfg.label.expr)):
        if expr is None:
            continue
        try:
            dt = table.selectExpr(f"{sql_expr(expr, fields)} AS _probe").schema.fields[0].dataType
        except Exception as exc:  # noqa: BLE001 - AnalysisException / ParseException
            raise InputDataError(f"{key} {expr!r} is not a column or valid expression over {where}: "
                                 f"{first_line(exc)}") from None
        if key == "label.expr" and not isinstance(dt, scalar):
            raise InputDataError(f"label.expr {expr!r} has type {dt.simpleString()}, which cannot be cast to a number")


def _require_type(ok: bool, column: str, key: str, dtype, want: str, where: str) -> None:
    if not ok:
        raise InputDataError(f"column {column!r} ({key}) in {where} has type {dtype.simpleString()}, "
                             f"which cannot be cast to {want}; fix the source schema or convert it in the query")


def sql_expr(text: str, fields) -> str:
    """A config value that is either a column name or a SQL expression."""
    return q(text) if text in fields else text


def row_columns(table, cfg: ShardConfig) -> list[str]:
    """SQL select list: the table's columns plus split, shuffle key, typed values and ``_reason``.
    (The bucket, the shuffle key's top bits, is taken from ``_shuffle`` by the caller, not hashed again.)"""
    from pyspark.sql import types as T

    fields = {f.name: f.dataType for f in table.schema.fields}
    feats, label, split = cfg.features, cfg.label, cfg.split
    seed = int(split.seed)
    cols = [q(c) for c in table.columns]
    key = f"CAST({sql_expr(split.key, fields)} AS STRING)"
    label_raw = sql_expr(label.column, fields) if label.column is not None else f"({label.expr})"
    transfer = label.unlabeled == "transfer"
    split_sql = split_index_sql(key, seed, split.fractions)
    if transfer:
        # Every unlabelled row joins the train split's transfer set; the labelled rows split as always,
        # so val and test hold the same rows as with label.unlabeled=quarantine.
        split_sql = f"CASE WHEN {label_raw} IS NULL THEN {list(split.fractions).index('train')} ELSE {split_sql} END"
    cols.append(f"{split_sql} AS _split")
    # The seeded shuffle key hashes the key and every used value, so rows of one group still shuffle.
    used = [q(c) for c in feats.all_columns]
    if label.column is not None:
        used.append(q(label.column))
    cols.append(f"xxhash64({seed + 1}, {key}, {', '.join(used)}) AS _shuffle")
    cols.append(f"xxhash64({seed + 2}, {key}, {', '.join(used)}) AS _tiebreak")

    reasons = []
    text = [c for c in [*feats.numeric, *feats.categorical, *([label.column] if label.column else [])]
            if isinstance(fields[c], T.StringType)]
    reasons += encoding_reasons(text)
    label_d = f"try_cast({label_raw} AS DOUBLE)"
    if not transfer:
        reasons.append(f"WHEN {label_raw} IS NULL THEN 'null_label'")
    if label.task == "classification":
        invalid = (f"{label_d} IS NULL OR isnan({label_d}) OR abs({label_d}) = double('Infinity') "
                   f"OR {label_d} <> floor({label_d}) OR {label_d} < 0 OR {label_d} >= {label.num_classes}")
        # try_cast: the checked rows are persisted whole, bad rows too, so an invalid label (NaN,
        # huge) must not fail the cast under ANSI mode (Spark 4); valid labels cast the same.
        cols.append(f"try_cast({label_d} AS BIGINT) AS _label")
    else:
        invalid = f"{label_d} IS NULL OR isnan({label_d}) OR abs({label_d}) > {FLOAT_MAX!r}"
        cols.append(f"CAST({label_d} AS FLOAT) AS _label")
    # A transfer row's label stays null here (left out of class counts and moments); the shard
    # writer stores MISSING_LABEL in its place.
    reasons.append(f"WHEN {label_raw} IS NOT NULL AND ({invalid}) THEN 'invalid_label'" if transfer
                   else f"WHEN {invalid} THEN 'invalid_label'")

    for name in feats.numeric:
        reasons += numeric_reasons(name, fields[name])
        cols.append(f"{numeric_value(name)} AS {q(num_col(name))}")
    for name in feats.categorical:
        reasons += category_reasons(name, feats.max_category_bytes)
        cols.append(f"CAST({q(name)} AS STRING) AS {q(cat_col(name))}")
    for name, shape in feats.arrays.items():
        reasons += array_reasons(name, shape)
        cols.append(f"{array_value(name)} AS {q(arr_col(name))}")
    cols.append(f"CASE {' '.join(reasons)} END AS _reason")
    return cols


@dataclass
class FittedStats:
    numeric: list[dict]       # manifest entries: name, mean, std, fill, null_share
    categorical: list[dict]   # name, vocab, num_embeddings, null_share
    arrays: list[dict]        # name, shape, null_share
    label: dict               # manifest label spec


def fit(clean_train: Callable, cfg: ShardConfig, summary: Summary) -> FittedStats:
    """Statistics and vocabularies of the train split's clean rows from the shard job's one scan
    of them (``summary``: exact moments of ``moment_values(cfg)``, value counts, class counts). A
    categorical feature the scan left uncounted (too many distinct values) is ranked by a Spark
    aggregation over ``clean_train()`` (those rows as a DataFrame, made only then) instead.
    Each feature's ``null_share`` is its nulls over the train rows the summary counted: the
    typed value is null exactly where the raw one is (a value that does not cast is quarantined),
    and an array's is 0 (a null array is quarantined)."""
    moments = list(summary.moments)
    label_moments = moments.pop() if cfg.label.task == "regression" else None
    feats = cfg.features
    vocabularies = {name: top_values(counts, feats.min_count, feats.max_vocab)
                    for name, counts in summary.value_counts.items() if counts is not None}
    wide = [name for name in feats.categorical if name not in vocabularies]
    if wide:
        vocabularies.update(spark_vocabularies(clean_train(), wide, feats.min_count, feats.max_vocab))
    shares = _null_shares(summary)
    numeric = _numeric_stats(cfg.features, moments)
    categorical = _categorical_stats(cfg.features, vocabularies)
    arrays = [{"name": n, "shape": list(s)} for n, s in feats.arrays.items()]
    for record in [*numeric, *categorical, *arrays]:
        record[NULL_SHARE] = shares[record["name"]]
    return FittedStats(numeric=numeric, categorical=categorical, arrays=arrays,
                       label=_label_stats(cfg.label, summary.class_counts, label_moments))


def _null_shares(summary: Summary) -> dict[str, float]:
    """Each counted feature's nulls over the train rows (0 for no rows: nothing was missing)."""
    rows = summary.train_rows
    return {name: nulls / rows if rows else 0.0 for name, nulls in summary.null_counts.items()}


def _numeric_stats(feats, moments: list[tuple[int, float, float]]) -> list[dict]:
    """Mean, std and fill of each numeric feature from its train moments."""
    numeric = []
    for name, (count, mean, m2) in zip(feats.numeric, moments):
        std = math.sqrt(m2 / count) if count else 0.0
        mean = mean if count else 0.0
        # A constant (or all-null) column must not divide by zero: it standardizes to 0.
        std = std if std > 0 else 1.0
        fill = float(feats.impute[name]) if name in feats.impute else mean
        numeric.append({"name": name, "mean": mean, "std": std, "fill": fill})
    return numeric


def spark_vocabularies(clean_train, names: list[str], min_count: int, max_vocab: int) -> dict[str, list[str]]:
    """Vocabularies of ``names`` by one Spark aggregation, (column, value) -> count, then the top
    values per column by a window: for features with too many distinct values to count on the
    driver. The same order as ``summary.top_values``: most frequent first, ties by value, at
    most max_vocab values seen at least min_count times."""
    from pyspark.sql import functions as F
    from pyspark.sql import Window

    stacked = [F.struct(F.lit(name).alias("column"), F.col(q(cat_col(name))).alias("value")) for name in names]
    counts = (clean_train.select(F.explode(F.array(*stacked)).alias("e")).select("e.column", "e.value")
              .where(F.col("value").isNotNull()).groupBy("column", "value").count())
    rank = F.row_number().over(Window.partitionBy("column").orderBy(F.desc("count"), F.asc("value")))
    top = counts.where(F.col("count") >= min_count).withColumn("rank", rank).where(F.col("rank") <= max_vocab)
    ranked: dict[str, list[tuple[int, str]]] = {name: [] for name in names}
    for row in top.collect():  # at most max_vocab values per column
        ranked[row["column"]].append((int(row["rank"]), row["value"]))
    return {name: [v for _, v in sorted(values)] for name, values in ranked.items()}


def _categorical_stats(feats, vocabularies: dict[str, list[str]]) -> list[dict]:
    return [{"name": name, "vocab": vocabularies[name], "num_embeddings": len(vocabularies[name]) + RESERVED_INDICES}
            for name in feats.categorical]


def _label_stats(label, class_counts: list[int], label_moments: tuple[int, float, float] | None) -> dict:
    """The manifest's label entry: class counts for classification, mean and std for regression."""
    spec = {"name": LABEL_NAME, "task": label.task, "source": label.column or label.expr}
    if label.task == "classification":
        spec.update(num_classes=label.num_classes, train_class_counts=class_counts)
    else:
        count, mean, m2 = label_moments
        spec.update(train_mean=mean if count else 0.0, train_std=math.sqrt(m2 / count) if count else 0.0)
    return spec


def moment_values(cfg: ShardConfig) -> list[str]:
    """The SQL values whose train-split moments ``fit`` needs: numeric features, a regression label."""
    values = [q(num_col(n)) for n in cfg.features.numeric]
    if cfg.label.task == "regression":
        values.append("CAST(_label AS DOUBLE)")
    return values


def stored_schema(cfg: ShardConfig, teacher: TeacherRecord | None = None) -> list[dict]:
    """The manifest's schema for this config (and teacher record): stored columns in file order
    (common.dataset decides it)."""
    features = {"numeric": [{"name": n} for n in cfg.features.numeric],
                "categorical": [{"name": n} for n in cfg.features.categorical],
                "arrays": [{"name": n, "shape": s} for n, s in cfg.features.arrays.items()]}
    return dataset_schema(features, {"name": LABEL_NAME, "task": cfg.label.task},
                          None if teacher is None else teacher.to_record())
