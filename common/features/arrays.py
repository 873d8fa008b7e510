"""Array features: a fixed-shape array of numbers per row, stored flattened as a float32 list.

Nothing is fitted: the shape is the shard config's (``features.arrays: {image: [28, 28]}``) and
the values are stored as they are. The network receives each array feature under its own name,
as float32 ``[rows, *shape]``.

Row rules (``common.rows``): ``bad_shape:<col>`` (null, or another length than the shape),
``non_finite:<col>`` (a null, NaN, inf or beyond-float32 element). Spark types the raw value as
ARRAY<FLOAT>; a raw value is never text.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from common.config import require
from common.errors import DatasetError
from common.features.base import BatchEntry, FeatureKind
from common.rows import FLOAT_MAX, beyond_float32, is_missing, mask, reason, reason_text
from common.sql import quote_identifier as q


MAX_ARRAY_VALUES = 1 << 24  # float32 values per row of one array feature (64 MiB): a typo fails at once


class Arrays(FeatureKind):
    name = "arrays"
    required = ("name", "shape")
    typed_prefix = "_a_"
    columns_type = dict[str, list[int]]
    columns_help = ("column -> its fixed shape, e.g. `{image: [28, 28]}`; a row of another length is quarantined "
                    "(`bad_shape:<column>`); stored flattened as float32")

    def __init__(self, records: list[dict], max_category_bytes: int):
        super().__init__(records, max_category_bytes)
        self.shapes = {r["name"]: tuple(r["shape"]) for r in self.records}

    @classmethod
    def check_record(cls, record: dict, where: str) -> None:
        shape = record.get("shape")
        if not isinstance(shape, list) or not shape or not all(isinstance(d, int) and d > 0 for d in shape):
            raise DatasetError(f"{where}: field 'features.arrays[{record.get('name')}].shape' is {shape!r}")

    # --- the shard config and Spark -------------------------------------------------------------

    @classmethod
    def check_config(cls, features_cfg) -> None:
        for name, shape in features_cfg.arrays.items():
            require(bool(shape) and all(isinstance(d, int) and d > 0 for d in shape),
                    f"arrays.{name}", f"must be a list of positive integers, got {shape}")
            require(math.prod(shape) <= MAX_ARRAY_VALUES, f"arrays.{name}",
                    f"holds {math.prod(shape):,} values per row, more than the limit of {MAX_ARRAY_VALUES:,}")

    @classmethod
    def configured(cls, features_cfg) -> list[dict]:
        return [{"name": name, "shape": list(shape)} for name, shape in features_cfg.arrays.items()]

    @staticmethod
    def config_key(name: str) -> str:
        return f"features.arrays.{name}"

    @staticmethod
    def spark_type_ok(dtype, stored: bool = False) -> bool:
        from pyspark.sql import types as T

        return isinstance(dtype, T.ArrayType) and isinstance(dtype.elementType, (T.NumericType, T.BooleanType))

    @staticmethod
    def wanted(stored: bool = False) -> str:
        return "array<float>"

    def sql_reasons(self, name: str, dtype, stored: bool = False) -> list[str]:
        """Null or of the wrong length; a null element, NaN (the largest value in Spark's ordering,
        so array_max finds it) or a value beyond float32. Array functions rather than lambdas
        (exists/transform), which Spark evaluates row by row outside its generated code: they
        doubled the checking cost."""
        top, bottom = f"CAST(array_max({q(name)}) AS DOUBLE)", f"CAST(array_min({q(name)}) AS DOUBLE)"
        return [f"WHEN {q(name)} IS NULL OR size({q(name)}) <> {math.prod(self.shapes[name])} "
                f"THEN {reason('bad_shape', name)}",
                f"WHEN size(array_compact({q(name)})) <> size({q(name)}) OR isnan({top}) "
                f"OR {top} > {FLOAT_MAX!r} OR {bottom} < {-FLOAT_MAX!r} THEN {reason('non_finite', name)}"]

    @staticmethod
    def typed_sql(name: str, stored: bool = False) -> str:
        """The value as ARRAY<FLOAT> (its length and elements are checked by ``sql_reasons``)."""
        return f"CAST({q(name)} AS ARRAY<FLOAT>)"

    # --- the manifest ---------------------------------------------------------------------------

    def stored_columns(self) -> list[dict]:
        return [{"name": name, "dtype": "float32", "shape": list(shape)} for name, shape in self.shapes.items()]

    def contract(self, record: dict) -> dict:
        return {"name": record["name"], "shape": list(record["shape"])}

    def input_entry(self) -> dict:
        return {name: list(shape) for name, shape in self.shapes.items()}

    @classmethod
    def teacher_names(cls, entries: list) -> dict:
        return {a["name"]: list(a["shape"]) for a in entries}

    # --- row rules on a frame -------------------------------------------------------------------

    def frame_checks(self, columns: dict, n: int) -> list[tuple[str, str, np.ndarray]]:
        checks = []
        for name, shape in self.shapes.items():
            bad_shape, non_finite = _array_checks(columns[name], n, math.prod(shape))
            checks += [(reason_text("bad_shape", name), name, bad_shape),
                       (reason_text("non_finite", name), name, non_finite)]
        return checks

    # --- serving and the model input ------------------------------------------------------------

    def encode_column(self, name: str, values: Any) -> np.ndarray:
        return _stacked_arrays(values, len(values), self.shapes[name])

    def stored_values(self, name: str, values: Any) -> Any:
        return values  # stored as typed: ARRAY<FLOAT>, checked by the row rules

    def batch_layout(self) -> list[BatchEntry]:
        return [BatchEntry(name, (name,), "float32", shape) for name, shape in self.shapes.items()]

    def batch(self, frame: Any, n: int) -> dict[str, np.ndarray]:
        return {name: self.encode_column(name, frame[name]) for name in self.shapes}

    def batch_keys(self) -> list[str]:
        return list(self.shapes)

    def probe(self, rows: int) -> dict[str, np.ndarray]:
        return {name: np.zeros((rows, *shape), dtype=np.float32) for name, shape in self.shapes.items()}

    def signature_columns(self) -> list:
        from mlflow.types import ColSpec, DataType
        from mlflow.types.schema import Array

        return [ColSpec(Array(DataType.double), name) for name in self.shapes]

    def raw_example(self, name: str, stored: Any) -> list:
        return [np.asarray(v, dtype=np.float32) for v in stored.to_pylist()]

    # --- inspect --------------------------------------------------------------------------------

    def summary_part(self) -> str:
        return "arrays " + ", ".join(f"{name} {list(shape)}" for name, shape in self.shapes.items())

    def html_table(self):
        from common.html_report import table

        if not self.records:
            return None
        return table(["array feature", "shape"], [[name, "x".join(map(str, shape))] for name, shape in self.shapes.items()])


def _stacked_arrays(column: Any, n: int, shape: tuple[int, ...]) -> np.ndarray:
    """An array feature as float32 [n, *shape]: an Arrow list column with every row present and of
    length prod(shape) is flattened and reshaped once; a pandas column of equal-length rows is
    stacked by numpy at once. Anything else (a null row, a row of another length) takes the
    row-by-row path, which raises the same error it always did."""
    import pyarrow as pa

    width = math.prod(shape)
    if isinstance(column, (pa.Array, pa.ChunkedArray)):
        whole = _flat_lists(column, n, width)
        if whole is not None:
            return whole.reshape((n, *shape))
        column = column.to_pandas()
    else:
        try:
            whole = np.asarray(list(column), dtype=np.float32)
        except (ValueError, TypeError):
            whole = None
        if whole is not None and whole.ndim >= 1 and len(whole) == n and whole.size == n * width:
            return whole.reshape((n, *shape))
    rows = [np.asarray(v, dtype=np.float32).reshape(shape) for v in column]
    return np.stack(rows) if rows else np.zeros((0, *shape), dtype=np.float32)


def _flat_lists(column: Any, n: int, width: int) -> np.ndarray | None:
    """An Arrow list column's elements as one float32 vector, or None unless every row is present
    and holds exactly ``width`` elements (a null element is NaN, as in its pandas conversion)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if not (pa.types.is_list(column.type) or pa.types.is_large_list(column.type)
            or pa.types.is_fixed_size_list(column.type)):
        return None
    if column.null_count or (n and not pc.all(pc.equal(pc.list_value_length(column), width)).as_py()):
        return None
    values = column.flatten()
    if not (pa.types.is_integer(values.type) or pa.types.is_floating(values.type)):
        return None  # booleans, strings, nested lists: their pandas conversion decides
    # A copy: a view of Arrow's buffer is read-only, and torch warns on (and must not write to) one.
    return np.array(values.to_numpy(zero_copy_only=False), dtype=np.float32)


def _array_checks(values, n: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(bad_shape, non_finite) masks of an array feature's column: Arrow lists of numbers at once,
    anything else (nested or ragged pandas values) row by row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    flat_list = isinstance(values, pa.Array) and (
        pa.types.is_list(values.type) or pa.types.is_large_list(values.type)
        or pa.types.is_fixed_size_list(values.type))
    element = values.type.value_type if flat_list else None
    if not (flat_list and (pa.types.is_integer(element) or pa.types.is_floating(element)
                           or pa.types.is_boolean(element))):
        checked = [_array_row(v, width) for v in (values if isinstance(values, list) else values.to_pylist())]
        return (np.fromiter((c == "bad_shape" for c in checked), dtype=bool, count=n),
                np.fromiter((c == "non_finite" for c in checked), dtype=bool, count=n))
    lengths = pc.fill_null(pc.list_value_length(values), -1).to_numpy(zero_copy_only=False)
    bad_shape = lengths != width
    flat = pc.list_flatten(values)
    parents = pc.list_parent_indices(values).to_numpy(zero_copy_only=False)
    elements = pc.fill_null(pc.cast(flat, pa.float64(), safe=False), 0.0).to_numpy(zero_copy_only=False)
    bad_elements = mask(pc.is_null(flat)) | beyond_float32(elements)
    non_finite = np.zeros(n, dtype=bool)
    non_finite[parents[bad_elements]] = True
    return bad_shape, non_finite & ~bad_shape


def _array_row(value: Any, width: int) -> str | None:
    """One row's array value: 'bad_shape', 'non_finite' or None (taken)."""
    if value is None or (not hasattr(value, "__len__") and is_missing(value)):
        return "bad_shape"
    try:
        elements = np.asarray(value, dtype=np.float64)  # a None element becomes NaN: refused below
    except (TypeError, ValueError):
        return "bad_shape"
    if elements.size != width:
        return "bad_shape"
    return "non_finite" if beyond_float32(elements.ravel()).any() else None
