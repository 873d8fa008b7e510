"""One scan of the checked rows for everything the driver must know before placing them.

The shard job needs, before it can encode and place a single row: the clean rows per (split,
bucket), the bad rows per reason, the exact moments of the train split's numeric values, the
train split's value counts per categorical feature and its rows per class. These were three
Spark aggregations, each a scan of the staged rows (the moments by ``posexplode`` into
(value, exponent) groups); here one ``mapInArrow`` pass over the few narrow columns they read
computes all of them per partition with numpy, and the driver adds the partitions' results.
At 2M rows that took the count and fit phases from 2.8 s to 1.3-1.9 s (benchmarks/RESULTS.md,
issue 11). The same pass counts each feature's nulls over the train split's clean rows, for the
manifest's null shares (what a score job compares its input with).

Everything is exact, so no result depends on how the rows are partitioned:
- counts are integers;
- a double x is sign * M * 2^k with M < 2^53 an integer (``np.frexp``); M is cut into three
  18-bit limbs, and per (value, k) a partition sums the limbs (for sum x) and the limb products
  grouped by weight (for sum x^2) as integers; the driver combines them with Python's integers
  and ``Fraction`` and rounds once: the correctly rounded mean and m2 (sum of squared
  deviations), which are unique, so any partitioning gives the same bits;
- value counts are per value; the ranking (most frequent first, ties by value) is made on the
  driver. A categorical feature with more than ``MAX_DISTINCT_PER_PARTITION`` values in one
  partition is not counted here: its vocabulary is left to Spark's aggregation
  (``preprocess.fit``), which ranks it without collecting every value to the driver.

Executor side: numpy and pyarrow only, picklable arguments.
"""

from __future__ import annotations

import functools
import math
import pickle
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from common.errors import InputDataError

MAX_DISTINCT_PER_PARTITION = 100_000
RESULT_DDL = "summary BINARY"

_LIMB_BITS = 18
_LIMBS = 3  # 3 * 18 >= 53
_WEIGHTS = 2 * _LIMBS - 1
# Per block, the per-exponent sums are taken with np.bincount in float64: each summand is an
# integer below 2^38 (a sum of at most 3 limb products below 2^36), so a block of 2^14 values
# sums below 2^52: exact. Blocks that size also stay in cache. The int64 running sums take
# 2^24 values (below 2^62) before they are added into Python ints.
_BLOCK = 1 << 14
_FLUSH_ROWS = 1 << 24
_MAX_EXACT_ROWS = 1 << 33  # the driver's limit on one value's count (the SQL form's 64-bit sums had the same)
# k = exponent - 53 for the smallest subnormal is -1074 - 53 + 1; offset so that every k indexes from 0.
_K_OFFSET = 1126
_K_SPAN = _K_OFFSET + 1024
_FLOAT64_MAX = 1.7976931348623157e308


@dataclass
class Summary:
    bucket_rows: dict[tuple[int, int], int]          # clean rows per (split index, bucket)
    by_reason: dict[str, int]                          # bad rows per reason
    moments: list[tuple[int, float, float]]            # (count, mean, m2) per moment value
    value_counts: dict[str, dict[str, int] | None]     # per categorical; None: too many values, ask Spark
    class_counts: list[int] = field(default_factory=list)  # rows per class (multi-hot labels: each class's rows)
    train_rows: int = 0                                # clean rows where ``selected`` holds
    label_rows: int = 0                                # of those, the rows with a label (class counts taken)
    null_counts: dict[str, int] = field(default_factory=dict)  # per ScanSpec.nulls feature, over those rows


def summarize(rows, *, split: str, bucket: str, reason: str, moments: list[str], categorical: dict[str, str],
              label: str | None, num_classes: int, selected: str, num_splits: int, bucket_bits: int,
              max_distinct: int = MAX_DISTINCT_PER_PARTITION) -> Summary:
    """One pass over ``rows`` (a DataFrame). SQL arguments, evaluated by Spark before the scan:
    ``split``/``bucket`` (ints) and ``reason`` (null for a clean row) count every row;
    ``moments`` (doubles), ``categorical`` (name -> string value) and ``label`` (class index) are
    taken over the clean rows where ``selected`` holds (the train split). ``max_distinct``: the
    most values of one categorical feature a partition counts before leaving it to Spark."""
    columns = [f"CAST({split} AS INT) AS s", f"CAST({bucket} AS INT) AS b", f"CAST({reason} AS STRING) AS r",
               f"CAST(({selected}) AS BOOLEAN) AS t"]
    columns += [f"CAST({value} AS DOUBLE) AS m{i}" for i, value in enumerate(moments)]
    columns += [f"CAST({value} AS STRING) AS c{i}" for i, value in enumerate(categorical.values())]
    if label is not None:
        columns.append(f"CAST({label} AS BIGINT) AS y")
    spec = ScanSpec(split="s", bucket="b", reason="r", moments=tuple(f"m{i}" for i in range(len(moments))),
                    categorical=tuple((name, f"c{i}") for i, name in enumerate(categorical)),
                    label="y" if label is not None else None, num_classes=num_classes, selected="t",
                    num_splits=num_splits, bucket_bits=bucket_bits, max_distinct=max_distinct)
    parts = rows.selectExpr(*columns).mapInArrow(functools.partial(_scan, spec=spec), RESULT_DDL).collect()
    return spec.merge([r["summary"] for r in parts], names=moments)


@dataclass(frozen=True)
class ScanSpec:
    """Where the summary's inputs are in a table of rows (by column name), so that the scan can
    run inside another pass over them (the shard job's staging writer): ``split``, ``bucket``,
    ``reason`` count every row; ``moments`` (floating point), ``categorical`` ((feature name,
    column of strings) pairs) and ``label`` (class index; a multilabel row's multi-hot list)
    are taken over the clean rows that ``selected`` picks: the split of that index, or where
    that boolean column is true; and over those rows, the nulls of each ``nulls`` column
    ((feature name, column) pairs)."""

    split: str
    bucket: str
    reason: str
    moments: tuple[str, ...]
    categorical: tuple[tuple[str, str], ...]
    label: str | None
    num_classes: int
    selected: int | str
    num_splits: int
    bucket_bits: int
    max_distinct: int = MAX_DISTINCT_PER_PARTITION
    nulls: tuple[tuple[str, str], ...] = ()

    def scanner(self) -> "Scanner":
        return Scanner(self)

    def merge(self, parts: list[bytes], names: list[str] | None = None) -> Summary:
        """The partitions' pickled results (``Scanner.result``) added up; ``names`` label the
        moment values in errors (default: their columns)."""
        return _merge([pickle.loads(p) for p in parts], list(names or self.moments),
                      [name for name, _ in self.categorical], self.num_classes, self.bucket_bits,
                      [name for name, _ in self.nulls])


class Scanner:
    """One partition's summary, fed whole tables of checked rows as they pass."""

    def __init__(self, spec: ScanSpec):
        self.spec = spec
        self.part = _Partial(len(spec.moments), len(spec.categorical), spec.label is not None, spec.num_classes,
                             spec.num_splits << spec.bucket_bits, spec.bucket_bits, spec.max_distinct,
                             len(spec.nulls))

    def add(self, table: pa.Table) -> None:
        spec = self.spec
        split = table.column(spec.split)
        selected = (table.column(spec.selected) if isinstance(spec.selected, str)
                    else pc.equal(split, pa.scalar(spec.selected, split.type)))
        columns = {"s": split, "b": table.column(spec.bucket), "r": table.column(spec.reason), "t": selected}
        columns.update({f"m{i}": table.column(c).cast(pa.float64()) for i, c in enumerate(spec.moments)})
        columns.update({f"c{i}": table.column(c) for i, (_, c) in enumerate(spec.categorical)})
        if spec.label is not None:
            columns["y"] = table.column(spec.label)
        # Whether each value is null, not the value: an array column would be copied by the filter.
        columns.update({f"n{i}": pc.is_null(table.column(c)) for i, (_, c) in enumerate(spec.nulls)})
        self.part.add(pa.table(columns))

    def result(self) -> bytes:
        return pickle.dumps(self.part.result())


def _scan(batches: Iterator[pa.RecordBatch], *, spec: ScanSpec) -> Iterator[pa.RecordBatch]:
    """mapInArrow body: one partition -> one pickled partial summary."""
    scanner = spec.scanner()
    for table in chunks(batches, _SCAN_ROWS):
        scanner.add(table)
    yield pa.RecordBatch.from_pylist([{"summary": scanner.result()}], schema=pa.schema([("summary", pa.binary())]))


_SCAN_ROWS = 1 << 18


def chunks(batches: Iterator[pa.RecordBatch], rows: int, max_bytes: int = 64 << 20) -> Iterator[pa.Table]:
    """The non-empty batches regrouped into tables of about ``rows`` rows, or fewer once they
    hold ``max_bytes`` (wide array features: memory, and a list column joined into one array
    must stay under 2^31 elements), in contiguous memory, so that the per-call costs of numpy
    and pyarrow are paid per chunk, not per Arrow batch."""
    pending: list[pa.RecordBatch] = []
    count = size = 0
    for batch in batches:
        if not batch.num_rows:
            continue
        pending.append(batch)
        count += batch.num_rows
        size += batch.nbytes
        if count >= rows or size >= max_bytes:
            yield pa.Table.from_batches(pending).combine_chunks()
            pending, count, size = [], 0, 0
    if pending:
        yield pa.Table.from_batches(pending).combine_chunks()


class _Partial:
    """One partition's sums (see ``_scan``)."""

    def __init__(self, num_moments: int, num_categorical: int, with_label: bool, num_classes: int, keys: int,
                 bucket_bits: int, max_distinct: int, num_nulls: int = 0):
        self.bucket_rows = np.zeros(keys, dtype=np.int64)
        self.by_reason: dict[str, int] = {}
        self.moments = _MomentSums(num_moments)
        self.values: list[dict[str, int] | None] = [{} for _ in range(num_categorical)]
        self.class_counts = np.zeros(max(num_classes, 0), dtype=np.int64)
        self.keys, self.bucket_bits, self.max_distinct = keys, bucket_bits, max_distinct
        self.with_label, self.num_classes = with_label, num_classes
        self.train_rows = self.label_rows = 0
        self.null_counts = [0] * num_nulls

    def add(self, table: pa.Table) -> None:
        reason = table.column("r")
        clean = pc.is_null(reason)
        if reason.null_count < len(reason):  # any bad rows (a chunk can hold only bad ones)
            for item in pc.value_counts(reason.drop_null()).to_pylist():
                self.by_reason[item["values"]] = self.by_reason.get(item["values"], 0) + item["counts"]
        keys = table.select(["s", "b"]).filter(clean)  # a bad row's split may be null
        key = (_ints(keys.column("s")) << self.bucket_bits) + _ints(keys.column("b"))
        if len(key):
            self.bucket_rows += np.bincount(key, minlength=self.keys)[:self.keys]
        picked = table.filter(pc.and_(clean, pc.fill_null(table.column("t"), False)))
        if not picked.num_rows:
            return
        self.train_rows += picked.num_rows
        for i in range(len(self.null_counts)):
            self.null_counts[i] += pc.sum(picked.column(f"n{i}")).as_py() or 0
        self.moments.add([picked.column(f"m{i}") for i in range(self.moments.num_values)])
        for i, counts in enumerate(self.values):
            if counts is None:
                continue
            for item in pc.value_counts(picked.column(f"c{i}").drop_null()).to_pylist():
                counts[item["values"]] = counts.get(item["values"], 0) + item["counts"]
            if len(counts) > self.max_distinct:
                self.values[i] = None  # Spark's aggregation ranks this one (see the module docstring)
        if self.with_label:
            labels = picked.column("y").drop_null()
            self.label_rows += len(labels)
            if len(labels):
                self.class_counts += _class_counts(labels, self.num_classes)

    def result(self) -> dict:
        # Sparse: a staging task's rows fill only its own range of buckets.
        keys = np.flatnonzero(self.bucket_rows)
        return {"bucket_rows": (keys, self.bucket_rows[keys]), "by_reason": self.by_reason, "moments": self.moments.groups,
                "values": self.values, "class_counts": self.class_counts, "train_rows": self.train_rows,
                "label_rows": self.label_rows, "null_counts": self.null_counts}


def _class_counts(labels, num_classes: int) -> np.ndarray:
    """Rows per class of non-null labels: class indices counted, or multi-hot rows (a list
    column: multilabel) summed, each class its rows."""
    if pa.types.is_list(labels.type) or pa.types.is_large_list(labels.type):
        hot = pc.list_flatten(labels).to_numpy().reshape(len(labels), num_classes)
        return (hot > 0).sum(axis=0).astype(np.int64)
    return np.bincount(_ints(labels), minlength=num_classes)[:num_classes]


def _ints(column) -> np.ndarray:
    return column.to_numpy().astype(np.int64, copy=False) if len(column) else np.zeros(0, dtype=np.int64)


class _MomentSums:
    """Per value and exponent k: [count, limb sums (signed), limb product sums by weight], as Python ints.

    Worked in blocks of ``_BLOCK`` values that stay in cache: each block's sums are exact in
    float64 (np.bincount), added into int64 running sums, and those into Python ints before they
    could overflow."""

    def __init__(self, num_values: int):
        self.num_values = num_values
        self._groups: list[dict[int, list[int]]] = [{} for _ in range(num_values)]
        self._running = np.zeros((1 + _LIMBS + _WEIGHTS, num_values * _K_SPAN), dtype=np.int64)
        self._running_rows = 0

    @property
    def groups(self) -> list[dict[int, list[int]]]:
        self._flush()
        return self._groups

    def add(self, columns: list) -> None:
        if not columns:
            return
        # All values at once: value i's exponents index bins i * _K_SPAN + k + _K_OFFSET.
        parts, bases = [], []
        for i, column in enumerate(columns):
            x = column.drop_null().to_numpy().astype(np.float64, copy=False)
            parts.append(x)
            bases.append(np.full(len(x), i * _K_SPAN, dtype=np.int64))
        x, base = np.concatenate(parts), np.concatenate(bases)
        if not np.isfinite(x).all():
            raise ValueError("a moment value is infinite; the row checks should have quarantined it")
        for start in range(0, len(x), _BLOCK):
            self._add(x[start:start + _BLOCK], base[start:start + _BLOCK])

    def _add(self, x: np.ndarray, base: np.ndarray) -> None:
        if self._running_rows + len(x) > _FLUSH_ROWS:
            self._flush()
        fraction, exponent = np.frexp(np.abs(x))  # |x| = fraction * 2^exponent, fraction in [0.5, 1) or 0
        mantissa = np.ldexp(fraction, 53).astype(np.int64)  # < 2^53, exact: a double has 53 significant bits
        exponent += _K_OFFSET - 53
        exponent[mantissa == 0] = _K_OFFSET  # zero: M = 0 at k = 0
        index = base + exponent
        mask = (1 << _LIMB_BITS) - 1
        limbs = [((mantissa >> (_LIMB_BITS * j)) & mask).astype(np.float64) for j in range(_LIMBS)]
        signed = np.where(x < 0, -1.0, 1.0)
        span = self._running.shape[1]
        running = self._running
        running[0] += np.bincount(index, minlength=span)
        for j, limb in enumerate(limbs):
            running[1 + j] += np.bincount(index, weights=signed * limb, minlength=span).astype(np.int64)
        for w in range(_WEIGHTS):
            terms = [limbs[a] * limbs[w - a] for a in range(_LIMBS) if 0 <= w - a < _LIMBS]
            running[1 + _LIMBS + w] += np.bincount(index, weights=functools.reduce(np.add, terms),
                                                   minlength=span).astype(np.int64)
        self._running_rows += len(x)

    def _flush(self) -> None:
        running = self._running
        for b in np.flatnonzero(running[0]):
            value, k = divmod(int(b), _K_SPAN)
            group = self._groups[value].setdefault(k - _K_OFFSET, [0] * running.shape[0])
            for j in range(running.shape[0]):
                group[j] += int(running[j, b])
        running[:] = 0
        self._running_rows = 0


def combine_moments(value: str, groups: dict[int, list[int]]) -> tuple[int, float, float]:
    """One value's (count, mean, m2) from its per-exponent integer sums, exactly, then rounded once."""
    count = sum(g[0] for g in groups.values())
    if count == 0:
        return 0, 0.0, 0.0
    if count >= _MAX_EXACT_ROWS:
        raise InputDataError(f"{value}: {count} train values, more than the {_MAX_EXACT_ROWS} whose exact "
                             "statistics this job computes; shard a sample or a smaller train split")
    total = 0
    squares = 0
    low = min(groups)  # scale every group to 2^low (total) and 2^(2 low) (squares): integers throughout
    for k, g in groups.items():
        limb_sum = sum(g[1 + j] << (_LIMB_BITS * j) for j in range(_LIMBS))
        product_sum = sum(g[1 + _LIMBS + w] << (_LIMB_BITS * w) for w in range(_WEIGHTS))
        total += limb_sum << (k - low)
        squares += product_sum << (2 * (k - low))
    # mean = total 2^low / count; m2 = (squares - total^2 / count) 2^(2 low)
    mean = Fraction(total, count) * Fraction(2) ** low
    m2 = Fraction(squares * count - total * total, count) * Fraction(2) ** (2 * low)
    # The mean of finite doubles is a finite double; m2 of huge ones may not be: inf, as in doubles.
    return count, float(mean), float(m2) if m2 <= _FLOAT64_MAX else math.inf


def _merge(parts: list[dict], moments: list[str], categorical: list[str], num_classes: int,
           bucket_bits: int, nulls: list[str] = ()) -> Summary:
    bucket_rows: dict[tuple[int, int], int] = {}
    by_reason: dict[str, int] = {}
    groups: list[dict[int, list[int]]] = [{} for _ in moments]
    values: list[dict[str, int] | None] = [{} for _ in categorical]
    class_counts = [0] * max(num_classes, 0)
    null_counts = dict.fromkeys(nulls, 0)
    train_rows = label_rows = 0
    for part in parts:
        for key, n in zip(*part["bucket_rows"]):
            k = (int(key) >> bucket_bits, int(key) & ((1 << bucket_bits) - 1))
            bucket_rows[k] = bucket_rows.get(k, 0) + int(n)
        for reason, n in part["by_reason"].items():
            by_reason[reason] = by_reason.get(reason, 0) + n
        for mine, theirs in zip(groups, part["moments"]):
            for k, sums in theirs.items():
                mine[k] = [a + b for a, b in zip(mine.get(k, [0] * len(sums)), sums)]
        for i, counts in enumerate(part["values"]):
            if counts is None or values[i] is None:
                values[i] = None
                continue
            for value, n in counts.items():
                values[i][value] = values[i].get(value, 0) + n
        for c, n in enumerate(part["class_counts"]):
            class_counts[c] += int(n)
        train_rows += part["train_rows"]
        label_rows += part["label_rows"]
        for name, n in zip(nulls, part["null_counts"]):
            null_counts[name] += n
    return Summary(bucket_rows=bucket_rows, by_reason=by_reason,
                   moments=[combine_moments(v, g) for v, g in zip(moments, groups)],
                   value_counts=dict(zip(categorical, values)), class_counts=class_counts,
                   train_rows=train_rows, label_rows=label_rows, null_counts=null_counts)


def exact_moments(rows, values: list[str], condition: str) -> list[tuple[int, float, float]]:
    """(count, mean, m2) of each SQL value over the rows meeting ``condition``, nulls skipped:
    the correctly rounded figures, the same bits on any partitioning (a ``summarize`` scan with
    only moments)."""
    return summarize(rows, split="0", bucket="0", reason="CAST(NULL AS STRING)", moments=values, categorical={},
                     label=None, num_classes=0, selected=condition, num_splits=1, bucket_bits=0).moments


