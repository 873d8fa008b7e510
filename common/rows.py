"""The row rules a raw feature value must pass: one set for the shard job (``pipelines.preprocess``),
scoring (``scoring.predict``) and a loaded model's ``predict`` on a pandas or Arrow frame
(``common.model_artifact``).

Every stage must refuse exactly the same rows: a model scores what it was trained on, and a row
the shard job would have kept out of the statistics must not get a prediction, in Spark or in
pandas. So the rules and the typing of a feature's raw value live here once, in order:

* text (a numeric or categorical feature's string values): ``bad_encoding`` (holds U+FFFD, which
  Spark's CSV/JSON readers put in place of bytes that are not valid UTF-8; in pandas also bytes
  that do not decode as UTF-8, or a str with a lone surrogate), one reason for every text column;
* numeric: ``bad_value:<col>`` (text that is not a number), ``non_finite:<col>`` (NaN, +/-inf,
  or beyond float32); null is no reason (it is imputed); typed as DOUBLE;
* categorical: ``too_long:<col>`` (more UTF-8 bytes than the shard job's
  features.max_category_bytes); null and unseen values are no reason (they have their indices);
* array: ``bad_shape:<col>`` (null, or another length than the shape), ``non_finite:<col>`` (a
  null, NaN, inf or beyond-float32 element); typed as ARRAY<FLOAT>.

Each rule is here in its two forms side by side: Spark SQL CASE branches built on the driver
(``*_reasons``; the shard job and ``score``), and the same test on a pandas or Arrow frame's
columns, whole columns at once (``frame_refusals``; ``predict`` and the MLflow pyfunc). Both take
the features in the same order (the text rule, then numeric, categorical, array features) and a
row gets the first reason it breaks. One difference is pandas' own: a pandas frame writes a
missing value as NaN (or None, pd.NA), so there NaN is null and imputed; an Arrow table's NaN
is a value, refused as Spark refuses it. A number in text is read by Python's float() (digit
separators refused, as Spark refuses them) where Spark casts it.

What is stage-specific stays with its stage: the label's rules and the CASE that orders them
with these (pipelines.preprocess), the checks of stored encodings (scoring.predict). The SQL is
pure string building (pyspark imported only for ``numeric_reasons``' type test); the frame form
imports numpy and pyarrow.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.sql import quote_identifier as q
from common.sql import quote_string

FLOAT_MAX = 3.4028234663852886e38  # the largest float32: a feature or label is stored as float32
# The ceiling of the shard job's features.max_category_bytes: no vocabulary holds a longer
# category, so a model that does not record the limit it was trained with refuses beyond this.
MAX_CATEGORY_BYTES = 1 << 20
BAD_ENCODING = "bad_encoding"
REPLACEMENT = "\ufffd"  # what Spark decodes bytes that are not UTF-8 as

# What each rule means, for a message naming the row (the reason's part before ':').
MEANING = {
    BAD_ENCODING: "text that is not valid UTF-8 (or holds U+FFFD, which stands for bytes that were not)",
    "bad_value": "text that is not a number",
    "non_finite": "NaN, +/-inf or beyond float32; in an array, such an element or a null one",
    "too_long": "a category longer than the shard job's features.max_category_bytes",
    "bad_shape": "no array, or an array of another length than the model's shape",
}


def reason_text(rule: str, column: str) -> str:
    """A reason naming a column, e.g. 'non_finite:price-usd'."""
    return f"{rule}:{column}"


def reason(rule: str, column: str) -> str:
    """The SQL literal of a reason naming a column, e.g. 'non_finite:price-usd'."""
    return quote_string(reason_text(rule, column))


# --- Spark SQL: CASE branches -------------------------------------------------------------------

def encoding_reasons(text_columns: list[str]) -> list[str]:
    """The CASE branch for the string columns a row uses: one holding U+FFFD would enter the
    vocabulary (or a number's text) as something else than the file holds."""
    if not text_columns:
        return []
    replaced = " OR ".join(f"instr({q(c)}, '{REPLACEMENT}') > 0" for c in text_columns)
    return [f"WHEN {replaced} THEN {quote_string(BAD_ENCODING)}"]


def numeric_reasons(name: str, dtype) -> list[str]:
    """CASE branches for a numeric feature: text that is not a number; NaN, +/-inf or a value
    beyond float32 (1e300 would make the train statistics infinite and store 0 for every row, or
    score as NaN probabilities). Null is not a reason: it is imputed."""
    from pyspark.sql import types as T

    value = numeric_value(name)
    reasons = []
    if isinstance(dtype, T.StringType):
        reasons.append(f"WHEN {q(name)} IS NOT NULL AND {value} IS NULL THEN {reason('bad_value', name)}")
    reasons.append(f"WHEN isnan({value}) OR abs({value}) > {FLOAT_MAX!r} THEN {reason('non_finite', name)}")
    return reasons


def numeric_value(name: str) -> str:
    """A numeric feature as DOUBLE (null, imputed later, where it is null or not a number)."""
    return f"try_cast({q(name)} AS DOUBLE)"


def category_reasons(name: str, max_bytes: int) -> list[str]:
    """CASE branch for a categorical feature: a value longer than the shard job took (almost
    always a broken record; each vocabulary entry lives in the manifest)."""
    return [f"WHEN octet_length(CAST({q(name)} AS STRING)) > {int(max_bytes)} THEN {reason('too_long', name)}"]


def array_reasons(name: str, shape) -> list[str]:
    """CASE branches for an array feature: null or of the wrong length; a null element, NaN (the
    largest value in Spark's ordering, so array_max finds it) or a value beyond float32. Array
    functions rather than lambdas (exists/transform), which Spark evaluates row by row outside
    its generated code: they doubled the checking cost."""
    top, bottom = f"CAST(array_max({q(name)}) AS DOUBLE)", f"CAST(array_min({q(name)}) AS DOUBLE)"
    return [f"WHEN {q(name)} IS NULL OR size({q(name)}) <> {math.prod(shape)} THEN {reason('bad_shape', name)}",
            f"WHEN size(array_compact({q(name)})) <> size({q(name)}) OR isnan({top}) "
            f"OR {top} > {FLOAT_MAX!r} OR {bottom} < {-FLOAT_MAX!r} THEN {reason('non_finite', name)}"]


def array_value(name: str) -> str:
    """An array feature as ARRAY<FLOAT> (its length and elements are checked by array_reasons)."""
    return f"CAST({q(name)} AS ARRAY<FLOAT>)"


# --- The same rules on a pandas or Arrow frame ---------------------------------------------------

@dataclass(frozen=True)
class Refusals:
    """Per row of a frame: the first rule it breaks (``reasons``, None where the row is taken),
    the column that rule found (``columns``), and whether the row is taken (``taken``)."""

    reasons: np.ndarray  # object
    columns: np.ndarray  # object
    taken: np.ndarray  # bool

    @property
    def first(self) -> int | None:
        """The position of the first refused row; None where every row is taken."""
        refused = np.flatnonzero(~self.taken)
        return int(refused[0]) if len(refused) else None


def frame_refusals(frame: Any, spec) -> Refusals:
    """The rules above on a pandas DataFrame or Arrow table of raw feature columns. ``spec``: the
    model's FeatureSpec (its ``numeric``, ``categorical``, ``arrays`` and ``max_category_bytes``);
    every feature column must be there."""
    columns = {name: _values(frame[name]) for name in spec.columns}
    n = frame.num_rows if hasattr(frame, "num_rows") else len(frame)
    checks = [(BAD_ENCODING, name, _bad_encoding(columns[name], n)) for name in [*spec.numeric, *spec.categorical]]
    for name in spec.numeric:
        bad, non_finite = _numeric_checks(columns[name], n)
        checks += [(reason_text("bad_value", name), name, bad), (reason_text("non_finite", name), name, non_finite)]
    for name in spec.categorical:
        checks.append((reason_text("too_long", name), name, _too_long(columns[name], n, spec.max_category_bytes)))
    for name, shape in spec.arrays.items():
        bad_shape, non_finite = _array_checks(columns[name], n, math.prod(shape))
        checks += [(reason_text("bad_shape", name), name, bad_shape),
                   (reason_text("non_finite", name), name, non_finite)]
    reasons, found = np.full(n, None, dtype=object), np.full(n, None, dtype=object)
    open_rows = np.ones(n, dtype=bool)
    for rule, column, mask in checks:  # in CASE order: the first rule a row breaks is its reason
        hit = mask & open_rows
        reasons[hit], found[hit] = rule, column
        open_rows &= ~hit
    return Refusals(reasons, found, open_rows)


def _values(column: Any):
    """A column as one Arrow array where Arrow holds it exactly (pandas' NaN as null, its missing
    value; a pandas categorical as its values), else as a list of its values, taken one by one
    (mixed types, a str with a lone surrogate, nested arrays)."""
    import pyarrow as pa

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if not isinstance(column, pa.Array):
        try:
            column = pa.array(column, from_pandas=True)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):  # UnicodeEncodeError is a ValueError
            return list(column)
    if pa.types.is_dictionary(column.type):
        column = column.dictionary_decode()
    return column


def _is_text(values) -> bool:
    import pyarrow as pa

    return isinstance(values, pa.Array) and (pa.types.is_string(values.type) or pa.types.is_large_string(values.type))


def _is_binary(values) -> bool:
    import pyarrow as pa

    return isinstance(values, pa.Array) and (pa.types.is_binary(values.type) or pa.types.is_large_binary(values.type))


def _mask(array) -> np.ndarray:
    """An Arrow boolean array as numpy, null as False."""
    import pyarrow.compute as pc

    return pc.fill_null(array, False).to_numpy(zero_copy_only=False).astype(bool)


def _each(values, n: int, test) -> np.ndarray:
    """``test(value)`` for each value, as a boolean mask."""
    items = values.to_pylist() if not isinstance(values, list) else values
    return np.fromiter((test(v) for v in items), dtype=bool, count=n)


def _missing(value: Any) -> bool:
    """A pandas or Arrow null: None, NaN (pandas' missing float), pd.NA, NaT."""
    if value is None:
        return True
    if isinstance(value, (float, np.floating)):
        return bool(np.isnan(value))
    return type(value).__name__ in ("NAType", "NaTType")


def _decoded(value: Any) -> str | None:
    """A text value as str, None where it is not valid UTF-8 (bytes that do not decode, a str
    with a lone surrogate, a U+FFFD standing for such bytes); the value itself where not text."""
    if isinstance(value, (bytes, bytearray)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return None
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return None
        return None if REPLACEMENT in value else value
    return value


def _bad_encoding(values, n: int) -> np.ndarray:
    import pyarrow.compute as pc

    if _is_text(values):
        return _mask(pc.match_substring(values, REPLACEMENT))
    if _is_binary(values) or isinstance(values, list):
        return _each(values, n, lambda v: isinstance(v, (str, bytes, bytearray)) and _decoded(v) is None)
    return np.zeros(n, dtype=bool)


def _numeric_checks(values, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(bad_value, non_finite) masks of a numeric feature's column."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(values, pa.Array) and (pa.types.is_integer(values.type) or pa.types.is_floating(values.type)
                                         or pa.types.is_boolean(values.type) or pa.types.is_decimal(values.type)):
        missing = _mask(pc.is_null(values))
        numbers = pc.fill_null(pc.cast(values, pa.float64(), safe=False), 0.0).to_numpy(zero_copy_only=False)
    elif isinstance(values, pa.Array) and pa.types.is_null(values.type):
        return np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    else:
        parsed = [_number(v) for v in (values if isinstance(values, list) else values.to_pylist())]
        bad = np.fromiter((p is _NOT_A_NUMBER for p in parsed), dtype=bool, count=n)
        missing = np.fromiter((p is None for p in parsed), dtype=bool, count=n)
        numbers = np.fromiter((0.0 if p is None or p is _NOT_A_NUMBER else p for p in parsed), dtype=np.float64,
                              count=n)
        return bad, ~missing & ~bad & _beyond_float32(numbers)
    return np.zeros(n, dtype=bool), ~missing & _beyond_float32(numbers)


def _beyond_float32(numbers: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return np.isnan(numbers) | (np.abs(numbers) > FLOAT_MAX)


_NOT_A_NUMBER = object()
# No number's string form is longer (an int64 has 20 characters, a float64's repr at most 24).
_NUMBER_FORM_BYTES = 32


def _number(value: Any):
    """A raw numeric value as float; None where it is missing (imputed), _NOT_A_NUMBER where it
    is text (or anything else) that is not a number."""
    if _missing(value):
        return None
    if isinstance(value, (bool, np.bool_)):
        return float(value)
    if isinstance(value, numbers.Number) or type(value).__name__ == "Decimal":
        try:
            return float(value)
        except OverflowError:  # an integer beyond any float
            return math.inf
    if isinstance(value, (bytes, bytearray)):
        value = _decoded(value)
    if isinstance(value, str) and "_" not in value:  # Python reads 1_000; Spark's cast does not
        try:
            return float(value.strip())
        except ValueError:
            pass
    return _NOT_A_NUMBER


def _too_long(values, n: int, max_bytes: int) -> np.ndarray:
    """A categorical value of more UTF-8 bytes than ``max_bytes`` (a non-text value: its str form)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if _is_text(values) or _is_binary(values):
        return _mask(pc.greater(pc.binary_length(values), max_bytes))
    if isinstance(values, pa.Array) and max_bytes >= _NUMBER_FORM_BYTES and (
            pa.types.is_integer(values.type) or pa.types.is_floating(values.type) or pa.types.is_boolean(values.type)):
        return np.zeros(n, dtype=bool)

    def too_long(v):
        if _missing(v):
            return False
        data = bytes(v) if isinstance(v, (bytes, bytearray)) else str(v).encode("utf-8", "surrogatepass")
        return len(data) > max_bytes

    return _each(values, n, too_long)


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
    bad_elements = _mask(pc.is_null(flat)) | _beyond_float32(elements)
    non_finite = np.zeros(n, dtype=bool)
    non_finite[parents[bad_elements]] = True
    return bad_shape, non_finite & ~bad_shape


def _array_row(value: Any, width: int) -> str | None:
    """One row's array value: 'bad_shape', 'non_finite' or None (taken)."""
    if value is None or (not hasattr(value, "__len__") and _missing(value)):
        return "bad_shape"
    try:
        elements = np.asarray(value, dtype=np.float64)  # a None element becomes NaN: refused below
    except (TypeError, ValueError):
        return "bad_shape"
    if elements.size != width:
        return "bad_shape"
    return "non_finite" if _beyond_float32(elements.ravel()).any() else None


__all__ = ["BAD_ENCODING", "FLOAT_MAX", "MAX_CATEGORY_BYTES", "MEANING", "Refusals", "array_reasons", "array_value",
           "category_reasons", "encoding_reasons", "frame_refusals", "numeric_reasons", "numeric_value", "reason",
           "reason_text"]
