"""Numeric features: a number per row, stored standardized as float32.

The shard job fits each one's mean and std on the train split's clean rows (exact moments,
pipelines/summary.py) and its ``fill`` (the train mean, or the config's ``features.impute``);
the stored value is ``(value - mean) / std`` computed in float64 and rounded once to float32, a
missing value (null, NaN in pandas) taking the fill first. The network receives all numeric
features of a row as one float32 matrix under ``batch["numeric"]``, in manifest order.

Row rules (``common.rows``): ``bad_value:<col>`` (text that is not a number), ``non_finite:<col>``
(NaN, +/-inf or beyond float32); null is no reason (it is imputed). Spark types the raw value as
DOUBLE; a raw value may be text, so ``bad_encoding`` applies.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from common.config import require
from common.errors import InputDataError
from common.features.base import ScalarColumns
from common.rows import FLOAT_MAX, beyond_float32, decoded, is_missing, mask, reason, reason_text
from common.sql import quote_identifier as q


class Numeric(ScalarColumns):
    name = "numeric"
    batch_dtype = "float32"
    text = True
    required = ("name", "mean", "std", "fill")
    typed_prefix = "_n_"
    columns_help = ("columns read as numbers: a null is imputed (the train mean, or `features.impute`), every value "
                    "standardized with the train split's mean and std; stored float32")
    options = (("impute", dict[str, float], dict,
                "numeric column -> the value stored for its nulls, instead of the train mean"),)

    def __init__(self, records: list[dict], max_category_bytes: int):
        super().__init__(records, max_category_bytes)
        self._stats = {r["name"]: r for r in self.records}

    # --- the shard config and Spark -------------------------------------------------------------

    @classmethod
    def check_config(cls, features_cfg) -> None:
        for name in features_cfg.impute:
            require(name in features_cfg.numeric, f"impute.{name}", "names a column that is not in features.numeric")

    @staticmethod
    def config_key(name: str) -> str:
        return "features.numeric"

    @staticmethod
    def spark_type_ok(dtype, stored: bool = False) -> bool:
        from pyspark.sql import types as T

        return isinstance(dtype, (T.NumericType, T.BooleanType) if stored else (T.NumericType, T.BooleanType, T.StringType))

    @staticmethod
    def wanted(stored: bool = False) -> str:
        return "a number"

    def moment_columns(self) -> list[tuple[str, str]]:
        return [(name, self.typed(name)) for name in self.names]

    def fit(self, features_cfg, train) -> list[dict]:
        """Mean, std and fill of each feature from its train moments. One with no value in any
        train row has nothing to learn from: storing it as all zeros would hide a broken input,
        unless the config says what to fill (``features.impute``)."""
        empty = [name for name in self.names if train.moments[name][0] == 0 and name not in features_cfg.impute]
        if empty:
            raise InputDataError(
                f"numeric feature column(s) {empty} (features.numeric) have no value in any train row (all null); "
                f"fix the input, remove the column from features.numeric, or give features.impute.{empty[0]} "
                "a value to store")
        records = []
        for name in self.names:
            count, mean, m2 = train.moments[name]
            std = math.sqrt(m2 / count) if count else 0.0
            mean = mean if count else 0.0
            # A constant (or all-null) column must not divide by zero: it standardizes to 0.
            std = std if std > 0 else 1.0
            fill = float(features_cfg.impute[name]) if name in features_cfg.impute else mean
            records.append({"name": name, "mean": mean, "std": std, "fill": fill})
        return records

    def sql_reasons(self, name: str, dtype, stored: bool = False) -> list[str]:
        """CASE branches: text that is not a number; NaN, +/-inf or a value beyond float32 (1e300
        would make the train statistics infinite and store 0 for every row, or score as NaN
        probabilities). Null is not a reason: it is imputed. A stored value was imputed by the
        shard job: there a gap means the data is not its output."""
        from pyspark.sql import types as T

        value = self.typed_sql(name)
        reasons = []
        if stored:
            reasons.append(f"WHEN {q(name)} IS NULL OR isnan(try_cast({q(name)} AS DOUBLE)) "
                           f"THEN {reason('bad_value', name)}")
        if isinstance(dtype, T.StringType):
            reasons.append(f"WHEN {q(name)} IS NOT NULL AND {value} IS NULL THEN {reason('bad_value', name)}")
        reasons.append(f"WHEN isnan({value}) OR abs({value}) > {FLOAT_MAX!r} THEN {reason('non_finite', name)}")
        return reasons

    @staticmethod
    def typed_sql(name: str, stored: bool = False) -> str:
        """The raw value as DOUBLE (null, imputed later, where it is null or not a number); a
        stored one as the float32 a network takes."""
        return f"CAST({q(name)} AS FLOAT)" if stored else f"try_cast({q(name)} AS DOUBLE)"

    # --- the manifest ---------------------------------------------------------------------------

    def stored_columns(self) -> list[dict]:
        return [{"name": name, "dtype": "float32", "shape": []} for name in self.names]

    # --- row rules on a frame -------------------------------------------------------------------

    def frame_checks(self, columns: dict, n: int) -> list[tuple[str, str, np.ndarray]]:
        checks = []
        for name in self.names:
            bad, non_finite = _numeric_checks(columns[name], n)
            checks += [(reason_text("bad_value", name), name, bad), (reason_text("non_finite", name), name, non_finite)]
        return checks

    # --- serving and the model input ------------------------------------------------------------

    def encode_column(self, name: str, values: Any) -> np.ndarray:
        """Standardized float32: (value - mean) / std in float64, then rounded once to float32; a
        missing value (NaN, also what a null becomes) and +/-inf take the fill first."""
        stats = self._stats[name]
        values = _float64_column(values)
        values = np.where(np.isfinite(values), values, stats["fill"])
        return ((values - stats["mean"]) / stats["std"]).astype(np.float32)

    def signature_columns(self) -> list:
        from mlflow.types import ColSpec
        from mlflow.types.schema import AnyType

        return [ColSpec(AnyType(), name) for name in self.names]

    def raw_example(self, name: str, stored: Any) -> Any:
        """Stored values back as raw ones (an MLflow input example)."""
        stats = self._stats[name]
        return stored.to_numpy().astype(np.float64) * stats["std"] + stats["mean"]

    # --- inspect --------------------------------------------------------------------------------

    def html_table(self):
        from common.html_report import table

        if not self.records:
            return None
        return table(["numeric feature", "train mean", "train std", "null filled with"],
                     [[f["name"], f.get("mean"), f.get("std"), f.get("fill")] for f in self.records])


def _float64_column(column: Any) -> np.ndarray:
    """A numeric column as float64 with NaN for a null: what ``np.asarray(pandas column, float64)``
    gives. Arrow floating columns convert directly (a null is NaN); other Arrow types go through
    their pandas conversion, so integers, booleans and decimals round exactly as before."""
    import pyarrow as pa

    if isinstance(column, (pa.Array, pa.ChunkedArray)):
        if pa.types.is_floating(column.type):
            return np.asarray(column.to_numpy(zero_copy_only=False), dtype=np.float64)
        column = column.to_pandas()
    return np.asarray(column, dtype=np.float64)


def _numeric_checks(values, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(bad_value, non_finite) masks of a numeric feature's column."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(values, pa.Array) and (pa.types.is_integer(values.type) or pa.types.is_floating(values.type)
                                         or pa.types.is_boolean(values.type) or pa.types.is_decimal(values.type)):
        missing = mask(pc.is_null(values))
        numbers_ = pc.fill_null(pc.cast(values, pa.float64(), safe=False), 0.0).to_numpy(zero_copy_only=False)
    elif isinstance(values, pa.Array) and pa.types.is_null(values.type):
        return np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    else:
        parsed = [_number(v) for v in (values if isinstance(values, list) else values.to_pylist())]
        bad = np.fromiter((p is NOT_A_NUMBER for p in parsed), dtype=bool, count=n)
        missing = np.fromiter((p is None for p in parsed), dtype=bool, count=n)
        numbers_ = np.fromiter((0.0 if p is None or p is NOT_A_NUMBER else p for p in parsed), dtype=np.float64,
                               count=n)
        return bad, ~missing & ~bad & beyond_float32(numbers_)
    return np.zeros(n, dtype=bool), ~missing & beyond_float32(numbers_)


NOT_A_NUMBER = object()


def _number(value: Any):
    """A raw numeric value as float; None where it is missing (imputed), NOT_A_NUMBER where it
    is text (or anything else) that is not a number."""
    if is_missing(value):
        return None
    if isinstance(value, (bool, np.bool_)):
        return float(value)
    if isinstance(value, numbers.Number) or type(value).__name__ == "Decimal":
        try:
            return float(value)
        except OverflowError:  # an integer beyond any float
            return math.inf
    if isinstance(value, (bytes, bytearray)):
        value = decoded(value)
    if isinstance(value, str) and "_" not in value:  # Python reads 1_000; Spark's cast does not
        try:
            return float(value.strip())
        except ValueError:
            pass
    return NOT_A_NUMBER
