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
those rows join the train split as transfer rows), ``invalid_label``, ``unknown_class`` (after the
features' rules: a class name outside ``label.classes``),
``too_long:<col>`` (a category longer than features.max_category_bytes),
``bad_value:<col>`` (a string that is not a number),
``non_finite:<col>`` (a numeric value that is NaN, +/-inf or beyond float32, as stored; a
null, NaN, inf or beyond-float32 element of an array), ``bad_shape:<col>`` (null array or wrong
length), and ``malformed_record`` (common/sources.py). A null numeric value is missing and is
imputed. The rules of a feature's raw value (text, numeric, categorical, array) are
``common.rows``, which scoring and a loaded model's ``predict`` apply too, so neither a statistic
nor a prediction ever sees a value float32 cannot hold or a category the shard job refused. The
label's rules, its typed value and its class list are ``pipelines.labels``'; this module puts
every rule in its place in the row's CASE, and must not define a feature rule of its own that
scoring would not apply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from pipelines.balance import split_index_sql
from common.errors import InputDataError, first_line
from common.features import KINDS, FeatureSpec
from common.features.spec import NULL_SHARE
from common.features.base import TrainSummary
from common.rows import encoding_reasons, raw_json_sql
from common.sql import quote_identifier as q
from common.dataset import LABEL_NAME, ROW_INDEX, TeacherRecord
from common.manifest_builder import stored_schema as dataset_schema
from pipelines.labels import LABEL_COLUMN, label_record, label_sql, label_type_ok, label_wanted
from pipelines.shard_config import ShardConfig
from pipelines.summary import Summary

RESERVED_NAMES = {LABEL_NAME, ROW_INDEX}


def configured_features(cfg: ShardConfig) -> FeatureSpec:
    """The config's features, one instance of each kind, before anything is fitted: what the row
    rules, the typed columns and ``fit`` loop over."""
    feats = cfg.features
    return FeatureSpec({kind.name: kind.configured(feats) for kind in KINDS}, feats.max_category_bytes)


def typed_features(cfg: ShardConfig) -> tuple[tuple[str, str], ...]:
    """(feature name, typed column) of every feature: the columns whose nulls on train the
    summary counts (``fit``'s null shares)."""
    return tuple((name, kind.typed(name)) for kind in configured_features(cfg).kinds for name in kind.names)


def prepared_table(table, cfg: ShardConfig):
    """``table`` with what the kinds' row rules read besides the raw columns, where a kind checks
    in a Python stage (an image's one decode, which also makes the bytes the job stores):
    ``FeatureKind.prepared``. The table itself where no kind needs one."""
    for kind in configured_features(cfg).kinds:
        table = kind.prepared(table, store=True)
    return table


def raw_text_sql(columns: list[str], cfg: ShardConfig) -> str:
    """SQL of a quarantined row's raw text (``common.rows.raw_json_sql``: an image's length, not
    its bytes; not the columns ``prepared_table`` added)."""
    return raw_json_sql(columns, configured_features(cfg))


def check_table(table, cfg: ShardConfig, where: str) -> None:
    """Missing columns and uncastable types fail here, before anything is read or written."""
    fields = {f.name: f.dataType for f in table.schema.fields}
    feats = cfg.features
    clash = sorted(RESERVED_NAMES & set(feats.all_columns))
    if clash:
        raise InputDataError(f"feature column(s) {clash} use a name the dataset reserves ({sorted(RESERVED_NAMES)}); "
                             f"rename them in the query")
    kinds = configured_features(cfg).kinds
    wanted = [(name, kind.config_key(name)) for kind in kinds for name in kind.names]
    if cfg.label.column is not None:
        wanted.append((cfg.label.column, "label.column"))
    for column, key in wanted:
        if column not in fields:
            raise InputDataError(f"column {column!r} ({key}) is not in {where}; it has columns {sorted(fields)}")

    for kind in kinds:
        for column in kind.names:
            _require_type(kind.spark_type_ok(fields[column]), column, kind.config_key(column), fields[column],
                          kind.wanted(), where)
    if cfg.label.column is not None:
        dtype = fields[cfg.label.column]
        _require_type(label_type_ok(cfg.label, dtype), cfg.label.column, "label.column", dtype,
                      label_wanted(cfg.label), where)

    # Expressions (label.expr, split.key) must analyse against the table.
    for key, expr in (("split.key", cfg.split.key), ("label.expr", cfg.label.expr)):
        if expr is None:
            continue
        try:
            dt = table.selectExpr(f"{sql_expr(expr, fields)} AS _probe").schema.fields[0].dataType
        except Exception as exc:  # noqa: BLE001 - AnalysisException / ParseException
            raise InputDataError(f"{key} {expr!r} is not a column or valid expression over {where}: "
                                 f"{first_line(exc)}") from None
        if key == "label.expr" and not label_type_ok(cfg.label, dt):
            raise InputDataError(f"label.expr {expr!r} has type {dt.simpleString()}, which cannot be cast to "
                                 f"{label_wanted(cfg.label)}")


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
    kinds = configured_features(cfg).kinds
    text = [c for c in [*(n for kind in kinds if kind.text for n in kind.names), *([label.column] if label.column else [])]
            if isinstance(fields[c], T.StringType)]
    reasons += encoding_reasons(text)
    label_rules = label_sql(label, label_raw)
    reasons += label_rules.first
    cols.append(f"{label_rules.typed} AS {LABEL_COLUMN}")
    for kind in kinds:
        for name in kind.names:
            reasons += kind.sql_reasons(name, fields[name])
            cols.append(f"{kind.typed_sql(name)} AS {q(kind.typed(name))}")
    reasons += label_rules.last
    cols.append(f"CASE {' '.join(reasons)} END AS _reason")
    return cols


@dataclass
class FittedStats:
    features: list[dict]      # the manifest's ``features``: a record per feature (its kind, statistics, null_share)
    label: dict               # manifest label spec


def fit(clean_train: Callable, cfg: ShardConfig, summary: Summary) -> FittedStats:
    """Statistics and vocabularies of the train split's clean rows, each kind fitting its own
    (``FeatureKind.fit``) from the shard job's one scan of them (``summary``: exact moments of
    ``scan_columns(cfg)``, value counts, class counts; ``clean_train()``: those rows as a
    DataFrame, made only where a kind asks for it). Each feature's ``null_share`` is its nulls
    over the train rows the summary counted: the typed value is null exactly where the raw one is
    (a value that does not cast is quarantined), and an array's is 0 (a null array is quarantined)."""
    moments = list(summary.moments)
    label_moments = None if cfg.label.classification else moments.pop()
    kinds = configured_features(cfg).kinds
    named = [name for kind in kinds for name, _ in kind.moment_columns()]
    train = TrainSummary(moments=dict(zip(named, moments)), value_counts=summary.value_counts, frame=clean_train)
    shares = _null_shares(summary)
    features = FeatureSpec({kind.name: kind.fit(cfg.features, train) for kind in kinds}).spec
    for record in features:
        record[NULL_SHARE] = shares[record["name"]]
    return FittedStats(features=features, label=label_record(cfg.label, summary.class_counts, label_moments,
                                                                summary.label_rows))


def _null_shares(summary: Summary) -> dict[str, float]:
    """Each counted feature's nulls over the train rows (0 for no rows: nothing was missing)."""
    rows = summary.train_rows
    return {name: nulls / rows if rows else 0.0 for name, nulls in summary.null_counts.items()}


def scan_columns(cfg: ShardConfig) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """What the shard job's scan of the train split computes for ``fit``: the typed columns whose
    moments the kinds need (then a regression label's, ``_label``), and (feature, typed column)
    of those whose values they count."""
    kinds = configured_features(cfg).kinds
    moments = tuple(col for kind in kinds for _, col in kind.moment_columns())
    moments += () if cfg.label.classification else ("_label",)
    return moments, tuple(pair for kind in kinds for pair in kind.counted_columns())


def stored_schema(cfg: ShardConfig, teacher: TeacherRecord | None = None) -> list[dict]:
    """The manifest's schema for this config (and teacher record): stored columns in file order
    (common.dataset decides it)."""
    label = {"name": LABEL_NAME, "task": cfg.label.task, "num_classes": cfg.label.num_classes}
    return dataset_schema(configured_features(cfg).spec, label,
                          None if teacher is None else teacher.to_record())
