"""Synthetic datasets for the demo, tests and benchmarks, written by Spark from a seed.

Every value is a pure function of (seed, id): rows come from ``spark.range`` and SQL hash
expressions, never from driver-side pandas or ``rand()``, so the same seed gives the same rows
at any size and on any number of partitions, and the driver holds nothing per row.

What gets written (``rows`` rows):
  id (bigint), x0..x{n-1} (double, with nulls), c0..c{m-1} (string, with nulls), optionally an
  array column ``image`` (array<float> of length prod(shape)) and a text column ``review`` (1 to 24
  words, one of which says which way a hidden term of the label goes), and ``label``: an int class in
  [0, num_classes) or a double (regression) that depends on the features, so a model can learn it.

``bad_rows`` injects exactly that many bad rows, cycling through the kinds the shard job must
quarantine (null label, invalid label, +inf in x0, wrong array length, and for CSV/JSON a record
that does not parse); ``GeneratedDataset.bad_by_reason`` says how many of each.

Must not: collect rows, or depend on the partitioning for any value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from common.features.arrays import Arrays
from common.features.categorical import Categorical
from common.features.numeric import Numeric
from common.features.text import Text
from common.errors import ConfigError
from common.tasks import LABEL_TASKS, TASK_NAMES, label_task

ARRAY_COLUMN = "image"
TEXT_COLUMN = "review"
# The review's words: fillers carry nothing; one word of the positive or the negative list says the
# sign of a term of the label's score that no other column holds.
FILLER_WORDS = ("the", "movie", "plot", "was", "actor", "quite", "very", "and", "scene", "film", "über", "naïve")
POSITIVE_WORDS = ("great", "lovely", "excellent", "fun", "brilliant")
NEGATIVE_WORDS = ("bad", "awful", "boring", "poor", "dull")
LABEL_COLUMN = "label"


@dataclass(frozen=True)
class GeneratedDataset:
    """What a generator run wrote, with enough to build a shard config over it."""

    path: str
    format: str
    rows: int
    seed: int
    numeric: list[str]
    categorical: list[str]
    arrays: dict[str, list[int]]
    label: str
    task: str
    num_classes: int | None
    schema_ddl: str  # how to read it back (required for CSV/JSON so bad records are detected)
    bad_by_reason: dict[str, int] = field(default_factory=dict)
    text: list[str] = field(default_factory=list)  # text columns (``review`` with text=True)

    def shard_config(self, output_path: str, **sections) -> dict:
        """A shard config (plain dict, ready for ``from_dict(ShardConfig, ...)``) over this data.

        Keyword arguments replace or extend whole sections: ``output={"num_shards": 2}`` is merged
        into the output section, ``split={"seed": 3}`` into split, and so on.
        """
        from common.config import deep_merge

        source = {"path": self.path, "format": self.format}
        if self.format != "parquet":
            source["schema"] = self.schema_ddl
        if self.format == "csv":
            source["options"] = {"header": True}
        label = {"column": self.label, "task": self.task}
        if label_task(self.task).classes:
            label["num_classes"] = self.num_classes
        cfg = {
            "sources": {"raw": source},
            "features": {Numeric.name: list(self.numeric), Categorical.name: list(self.categorical),
                         Arrays.name: {k: list(v) for k, v in self.arrays.items()},
                         Text.name: {name: {"tokenizer": {"vocab_size": 100}, "max_tokens": 32} for name in self.text}},
            "label": label,
            "split": {"key": "id", "fractions": {"train": 0.8, "val": 0.1, "test": 0.1}, "seed": 0},
            "output": {"path": output_path, "num_shards": 4},
        }
        return deep_merge(cfg, sections)


def generate_dataset(spark, path: str, rows: int, *, seed: int = 0,
                     format: Literal["parquet", "csv", "json"] = "parquet",
                     numeric: int = 4, categorical: int = 2, vocab_size: int = 20,
                     array_shape: list[int] | tuple[int, ...] | None = None,
                     task: Literal[TASK_NAMES] = "classification", num_classes: int = 2,
                     null_fraction: float = 0.05, bad_rows: int = 0, partitions: int | None = None,
                     mode: Literal["error", "overwrite"] = "error", text: bool = False) -> GeneratedDataset:
    """Write a synthetic dataset to ``path`` (any URI common.storage accepts) with Spark."""
    from common.spark import spark_errors, to_spark_path

    _check_args(rows, format, numeric, categorical, vocab_size, array_shape, task, num_classes,
                null_fraction, bad_rows, mode)
    partitions = partitions or max(2, math.ceil(rows / 1_000_000))
    shape = [int(d) for d in array_shape] if array_shape else []
    kinds = _bad_kinds(format, bool(shape))

    draws = spark.range(0, rows, 1, partitions).selectExpr(
        "id", *_latent_draws(seed, numeric, categorical, vocab_size), *_bad_row_picks(rows, bad_rows, kinds))
    if shape:
        draws = _with_array_draws(draws, seed, shape)
    if text:
        draws = draws.selectExpr("*", f"CASE WHEN {_uniform(seed, 901)} < 0.5 THEN -1.0 ELSE 1.0 END AS _text_sign")
    draws = draws.selectExpr("*", f"{_score(numeric, categorical, bool(shape), text)} AS _score")
    label = _label(numeric, categorical, bool(shape), task, num_classes, kinds, text)
    table = draws.selectExpr(
        "id", *_numeric_columns(seed, numeric, null_fraction, kinds),
        *_categorical_columns(seed, categorical, null_fraction), *_array_columns(shape, kinds),
        *([f"{_review(seed)} AS {TEXT_COLUMN}"] if text else []),
        f"{label} AS {LABEL_COLUMN}", f"{_malformed(kinds)} AS _malformed")

    with spark_errors(f"writing the generated dataset to {path}"):
        _write(table, to_spark_path(path), format, mode)
    return GeneratedDataset(
        path=path, format=format, rows=rows, seed=seed, numeric=_numeric_names(numeric),
        categorical=_categorical_names(categorical), arrays={ARRAY_COLUMN: shape} if shape else {},
        label=LABEL_COLUMN, task=task, num_classes=num_classes if label_task(task).classes else None,
        schema_ddl=_schema_ddl(numeric, categorical, bool(shape), task, text), bad_by_reason=_bad_counts(kinds, bad_rows),
        text=[TEXT_COLUMN] if text else [])


def _numeric_names(numeric: int) -> list[str]:
    return [f"x{j}" for j in range(numeric)]


def _categorical_names(categorical: int) -> list[str]:
    return [f"c{j}" for j in range(categorical)]


# Columns: hidden draws first (``_z``, ``_v``, ``_noise``, ``_arr``), from which the written
# columns and the label are built, so a feature and the label see the same value.

def _latent_draws(seed: int, numeric: int, categorical: int, vocab_size: int) -> list[str]:
    """A standard normal per numeric feature, a skewed category index per categorical one, label noise."""
    return [*[f"{_normal(seed, 10 + j)} AS _z{j}" for j in range(numeric)],
            *[f"CAST(floor(pow({_uniform(seed, 50 + j)}, 2) * {vocab_size}) AS INT) AS _v{j}"
              for j in range(categorical)],
            f"{_normal(seed, 99)} AS _noise"]


def _with_array_draws(draws, seed: int, shape: list[int]):
    """``_arr``: element i is a normal draw from (seed, id, 1000 + i); ``_arr_score``: its scaled sum, for the label."""
    length = math.prod(shape)
    element = _normal(seed, "1000 + i")
    draws = draws.selectExpr("*", f"transform(sequence(0, {length - 1}), i -> CAST({element} AS FLOAT)) AS _arr")
    return draws.selectExpr("*", f"aggregate(_arr, 0D, (acc, v) -> acc + v) / {math.sqrt(length)} AS _arr_score")


def _numeric_columns(seed: int, numeric: int, null_fraction: float, kinds: list[str]) -> list[str]:
    cols = []
    for j, name in enumerate(_numeric_names(numeric)):
        value = f"(_z{j} * {1 + j * 0.5} + {j * 2.0})"  # different scales, so standardizing matters
        value = _with_nulls(seed, 20 + j, null_fraction, value)
        if j == 0:
            value = _inject(kinds, "non_finite:x0", "double('Infinity')", value)
        cols.append(f"{value} AS {name}")
    return cols


def _categorical_columns(seed: int, categorical: int, null_fraction: float) -> list[str]:
    return [f"{_with_nulls(seed, 30 + j, null_fraction, _category_value(j))} AS {name}"
            for j, name in enumerate(_categorical_names(categorical))]


def _category_value(j: int) -> str:
    return f"concat('v', _v{j})"


def _array_columns(shape: list[int], kinds: list[str]) -> list[str]:
    if not shape:
        return []
    return [f"{_inject(kinds, f'bad_shape:{ARRAY_COLUMN}', 'concat(_arr, array(CAST(0 AS FLOAT)))', '_arr')} "
            f"AS {ARRAY_COLUMN}"]


def _with_nulls(seed: int, stream: int, null_fraction: float, value: str) -> str:
    return f"CASE WHEN {_uniform(seed, stream)} < {null_fraction} THEN NULL ELSE {value} END"


# The label: a score the features explain (linear in the numerics, a per-category effect, the
# array's mean), plus noise, so a model can learn it.

def _score(numeric: int, categorical: int, has_array: bool, has_text: bool = False) -> str:
    terms = [f"{(-1) ** j * (1.0 / (1 + j)):.6f} * _z{j}" for j in range(numeric)]
    terms += [f"(pmod(_v{j}, 3) - 1) * 0.7" for j in range(categorical)]
    if has_array:
        terms.append("0.8 * _arr_score")
    if has_text:
        terms.append("1.2 * _text_sign")
    return f"({' + '.join(terms) or '0'})"


def _score_std(numeric: int, categorical: int, has_array: bool, has_text: bool = False) -> float:
    """About the std of ``_score + 0.5 * _noise`` (independent terms; categories taken as uniform)."""
    variance = (sum((1.0 / (1 + j)) ** 2 for j in range(numeric)) + 0.49 * (2 / 3) * categorical
                + (0.64 if has_array else 0) + (1.44 if has_text else 0))
    return math.sqrt(variance + 0.25)


def _review(seed: int) -> str:
    """1 to 24 filler words, one sentiment word (its sign ``_text_sign``) at a drawn position."""
    def words(items) -> str:
        return "array(" + ", ".join(f"'{w}'" for w in items) + ")"

    count = f"CAST(1 + floor({_uniform(seed, 902)} * 24) AS INT)"
    filler = (f"transform(sequence(1, {count}), j -> element_at({words(FILLER_WORDS)}, "
              f"CAST(pmod(xxhash64({seed}, id, j), {len(FILLER_WORDS)}) + 1 AS INT)))")
    pick = f"CAST(1 + floor({_uniform(seed, 903)} * {len(POSITIVE_WORDS)}) AS INT)"
    sentiment = (f"CASE WHEN _text_sign > 0 THEN element_at({words(POSITIVE_WORDS)}, {pick}) "
                 f"ELSE element_at({words(NEGATIVE_WORDS)}, {pick}) END")
    cut = f"CAST(floor({_uniform(seed, 904)} * size({filler})) AS INT)"
    return (f"concat_ws(' ', slice({filler}, 1, {cut}), array({sentiment}), "
            f"slice({filler}, {cut} + 1, size({filler})))")


def _label(numeric: int, categorical: int, has_array: bool, task: str, num_classes: int, kinds: list[str],
           has_text: bool = False) -> str:
    if label_task(task).classes:
        # Logistic approximation of the normal CDF: classes come out roughly balanced.
        sd = _score_std(numeric, categorical, has_array, has_text)
        prob = f"1 / (1 + exp(-1.702 * (_score + 0.5 * _noise) / {sd:.6f}))"
        label = f"CAST(least(floor({prob} * {num_classes}), {num_classes - 1}) AS BIGINT)"
        invalid = f"CAST({num_classes + 1} AS BIGINT)"
    else:
        label = "(_score + 0.5 * _noise)"
        invalid = "double('NaN')"
    label = _inject(kinds, "null_label", "NULL", label)
    return _inject(kinds, "invalid_label", invalid, label)


# Bad rows: exactly ``bad_rows`` of them, spread evenly over the id range; the n-th bad row gets
# kind n % len(kinds), and each column's builder swaps in the bad value for its own kind.

def _bad_kinds(format: str, has_array: bool) -> list[str]:
    kinds = ["null_label", "invalid_label", "non_finite:x0"]
    if has_array:
        kinds.append(f"bad_shape:{ARRAY_COLUMN}")
    if format in ("csv", "json"):
        kinds.append("malformed_record")
    return kinds


def _bad_row_picks(rows: int, bad_rows: int, kinds: list[str]) -> list[str]:
    """``_bad``: the row is one of the bad ones (ids every-1, 2*every-1, ...); ``_kind``: which kind."""
    if not bad_rows:
        return ["false AS _bad", "0 AS _kind"]
    every = rows // bad_rows
    return [f"CAST((pmod(id, {every}) = {every - 1} AND id DIV {every} < {bad_rows}) AS BOOLEAN) AS _bad",
            f"CAST(pmod(id DIV {every}, {len(kinds)}) AS INT) AS _kind"]


def _inject(kinds: list[str], kind: str, bad_value: str, value: str) -> str:
    """``value``, except on the bad rows of ``kind``, which get ``bad_value``."""
    if kind not in kinds:
        return value
    return f"CASE WHEN {_is_kind(kinds, kind)} THEN {bad_value} ELSE {value} END"


def _is_kind(kinds: list[str], kind: str) -> str:
    return f"(_bad AND _kind = {kinds.index(kind)})"


def _malformed(kinds: list[str]) -> str:
    """Whether ``_write`` must spoil the row's record (CSV/JSON only)."""
    return _is_kind(kinds, "malformed_record") if "malformed_record" in kinds else "false"


def _bad_counts(kinds: list[str], bad_rows: int) -> dict[str, int]:
    counts = {kind: 0 for kind in kinds}
    for i in range(bad_rows):
        counts[kinds[i % len(kinds)]] += 1
    return {k: v for k, v in counts.items() if v}


def _schema_ddl(numeric: int, categorical: int, has_array: bool, task: str, has_text: bool = False) -> str:
    label_type = "BIGINT" if label_task(task).classes else "DOUBLE"
    return ", ".join(["id BIGINT", *[f"{n} DOUBLE" for n in _numeric_names(numeric)],
                      *[f"{n} STRING" for n in _categorical_names(categorical)],
                      *([f"{ARRAY_COLUMN} ARRAY<FLOAT>"] if has_array else []),
                      *([f"{TEXT_COLUMN} STRING"] if has_text else []), f"{LABEL_COLUMN} {label_type}"])


def _write(table, target: str, format: str, mode: str) -> None:
    columns = [c for c in table.columns if c != "_malformed"]
    if format == "parquet":
        table.select(*columns).write.mode(mode).parquet(target)
        return
    if format == "csv":
        # Every value goes out as text; a malformed record is one whose x0 does not parse as a number.
        text = [f"CASE WHEN _malformed THEN 'oops' ELSE CAST({c} AS STRING) END AS {c}" if c == "x0"
                else f"CAST({c} AS STRING) AS {c}" for c in columns]
        table.selectExpr(*text).write.mode(mode).option("header", "true").csv(target)
        return
    # JSON lines; a malformed record is a truncated line.
    line = (f"CASE WHEN _malformed THEN concat('{{\"id\": ', id, ', \"x0\": ') "
            f"ELSE to_json(struct({', '.join(columns)})) END AS value")
    table.selectExpr(line).write.mode(mode).text(target)


def _uniform(seed: int, stream) -> str:
    """A uniform draw in (0, 1) from 52 bits of xxhash64(seed, stream, id)."""
    return f"((CAST(xxhash64({int(seed)}, {stream}, id) & 4503599627370495 AS DOUBLE) + 0.5) / 4503599627370496.0)"


def _normal(seed: int, stream) -> str:
    """A standard normal draw (Box-Muller over two uniform streams)."""
    u1 = _uniform(seed, f"2 * ({stream})")
    u2 = _uniform(seed, f"2 * ({stream}) + 1")
    return f"(sqrt(-2 * ln({u1})) * cos(2 * pi() * {u2}))"


def _check_args(rows, format, numeric, categorical, vocab_size, array_shape, task, num_classes,
                null_fraction, bad_rows, mode) -> None:
    if rows < 1:
        raise ConfigError(f"rows must be >= 1, got {rows}")
    if format not in ("parquet", "csv", "json"):
        raise ConfigError(f"format must be parquet, csv or json, got {format!r}")
    if numeric < 1:
        raise ConfigError("numeric must be >= 1 (x0 carries the injected non-finite values)")
    if categorical < 0 or vocab_size < 1:
        raise ConfigError("categorical must be >= 0 and vocab_size >= 1")
    if array_shape and (format == "csv"):
        raise ConfigError("CSV cannot hold array columns; use format=parquet or json for array_shape")
    if array_shape and not all(int(d) > 0 for d in array_shape):
        raise ConfigError(f"array_shape must be positive integers, got {array_shape}")
    if task not in LABEL_TASKS or label_task(task).multi:
        single = [name for name, each in LABEL_TASKS.items() if not each.multi]
        raise ConfigError(f"task must be {' or '.join(single)} (the generator writes one label per row), got {task!r}")
    if label_task(task).classes and num_classes < 2:
        raise ConfigError(f"num_classes must be >= 2, got {num_classes}")
    if not 0 <= null_fraction < 1:
        raise ConfigError(f"null_fraction must be in [0, 1), got {null_fraction}")
    if not 0 <= bad_rows <= rows:
        raise ConfigError(f"bad_rows must be in [0, rows], got {bad_rows}")
    if mode not in ("error", "overwrite"):
        raise ConfigError(f"mode must be error or overwrite, got {mode!r}")
