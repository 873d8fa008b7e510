"""The row rules a raw feature value must pass, and how they are applied: one set for the shard job
(``pipelines.preprocess``), scoring (``scoring.predict``) and a loaded model's ``predict`` on a
pandas or Arrow frame (``common.model_artifact``).

Every stage must refuse exactly the same rows: a model scores what it was trained on, and a row
the shard job would have kept out of the statistics must not get a prediction, in Spark or in
pandas. Each feature kind (``common.features``) owns its rules, in both forms side by side: Spark
SQL CASE branches built on the driver (``sql_reasons``; the shard job and ``score``) and the same
test on a pandas or Arrow frame's columns, whole columns at once (``frame_checks``). This module
owns what they share: the rule every text column passes, ``bad_encoding`` (holds U+FFFD, which
Spark's CSV/JSON readers put in place of bytes that are not valid UTF-8; in pandas also bytes that
do not decode as UTF-8, or a str with a lone surrogate), reasons and their meanings, the order
(the text rule, then each kind's rules in ``KINDS`` order; a row gets the first reason it breaks:
``frame_refusals``), and the value tests the kinds use.

One difference is pandas' own: a pandas frame writes a missing value as NaN (or None, pd.NA), so
there NaN is null and imputed; an Arrow table's NaN is a value, refused as Spark refuses it. A
number in text is read by Python's float() (digit separators refused, as Spark refuses them)
where Spark casts it.

What is stage-specific stays with its stage: the label's rules and the CASE that orders them
with these (pipelines.preprocess), the checks of stored encodings (scoring.predict). The SQL is
pure string building; the frame form imports numpy and pyarrow.
"""

from __future__ import annotations

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
    "null_image": "no image bytes",
    "undecodable_image": "bytes that do not decode as an image (truncated, not an image, a format Pillow cannot read)",
    "image_too_large": "an image whose header claims more pixels than the feature's max_pixels (not decoded)",
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


def raw_json_sql(columns: list[str], spec) -> str:
    """SQL of a quarantined row's raw text (the shard job's and ``score``'s quarantine): its
    ``columns`` as JSON, each feature's as its kind keeps it (``FeatureKind.raw_sql``: an image's
    byte length, not its bytes), without the columns a kind's Python stage added
    (``FeatureKind.prepared_columns``). ``spec``: a ``FeatureSpec``; None: every column as it is."""
    kinds = spec.kinds if spec is not None else []
    hidden = {c for kind in kinds for c in kind.prepared_columns()}
    own = {name: kind.raw_sql(name) for kind in kinds for name in kind.names}
    fields = [q(c) if own.get(c, q(c)) == q(c) else f"{own[c]} AS {q(c)}" for c in columns if c not in hidden]
    return f"to_json(struct({', '.join(fields)}))"


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
    model's ``common.features.FeatureSpec`` (its kinds' rules, and ``max_category_bytes``); every
    feature column must be there."""
    columns = {name: _values(frame[name]) for name in spec.columns}
    n = frame.num_rows if hasattr(frame, "num_rows") else len(frame)
    checks = [(BAD_ENCODING, name, _bad_encoding(columns[name], n))
              for kind in spec.kinds if kind.text for name in kind.names]
    checks += [check for kind in spec.kinds for check in kind.frame_checks(columns, n)]
    reasons, found = np.full(n, None, dtype=object), np.full(n, None, dtype=object)
    open_rows = np.ones(n, dtype=bool)
    for rule, column, hits in checks:  # in CASE order: the first rule a row breaks is its reason
        hit = hits & open_rows
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


def is_text(values) -> bool:
    import pyarrow as pa

    return isinstance(values, pa.Array) and (pa.types.is_string(values.type) or pa.types.is_large_string(values.type))


def is_binary(values) -> bool:
    import pyarrow as pa

    return isinstance(values, pa.Array) and (pa.types.is_binary(values.type) or pa.types.is_large_binary(values.type))


def mask(array) -> np.ndarray:
    """An Arrow boolean array as numpy, null as False."""
    import pyarrow.compute as pc

    return pc.fill_null(array, False).to_numpy(zero_copy_only=False).astype(bool)


def each(values, n: int, test) -> np.ndarray:
    """``test(value)`` for each value, as a boolean mask."""
    items = values.to_pylist() if not isinstance(values, list) else values
    return np.fromiter((test(v) for v in items), dtype=bool, count=n)


def is_missing(value: Any) -> bool:
    """A pandas or Arrow null: None, NaN (pandas' missing float), pd.NA, NaT."""
    if value is None:
        return True
    if isinstance(value, (float, np.floating)):
        return bool(np.isnan(value))
    return type(value).__name__ in ("NAType", "NaTType")


def decoded(value: Any) -> str | None:
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

    if is_text(values):
        return mask(pc.match_substring(values, REPLACEMENT))
    if is_binary(values) or isinstance(values, list):
        return each(values, n, lambda v: isinstance(v, (str, bytes, bytearray)) and decoded(v) is None)
    return np.zeros(n, dtype=bool)


def beyond_float32(numbers: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return np.isnan(numbers) | (np.abs(numbers) > FLOAT_MAX)


__all__ = ["BAD_ENCODING", "FLOAT_MAX", "MAX_CATEGORY_BYTES", "MEANING", "Refusals", "beyond_float32", "decoded",
           "each", "encoding_reasons", "frame_refusals", "raw_json_sql", "is_binary", "is_missing", "is_text", "mask", "reason",
           "reason_text"]
