"""The row rules a raw feature value must pass, as Spark SQL built on the driver: one set for the
shard job (``pipelines.preprocess``) and scoring (``scoring.predict``).

Both stages must quarantine exactly the same rows: a model scores what it was trained on, and a
row the shard job would have kept out of the statistics must not get a prediction. So the rules
and the typing of a feature's raw value live here once:

* numeric: ``bad_value:<col>`` (a string that is not a number), ``non_finite:<col>`` (NaN,
  +/-inf, or beyond float32); null is no reason (it is imputed); typed as DOUBLE;
* array: ``bad_shape:<col>`` (null, or another length than the shape), ``non_finite:<col>`` (a
  null, NaN, inf or beyond-float32 element); typed as ARRAY<FLOAT>.

What is stage-specific stays with its stage: the label's rules, categories' length and the CASE
that orders the rules (pipelines.preprocess), the checks of stored encodings (scoring.predict).
Pure string building: imports pyspark only for the type test of ``numeric_reasons``.
"""

from __future__ import annotations

import math

from common.sql import quote_identifier as q
from common.sql import quote_string

FLOAT_MAX = 3.4028234663852886e38  # the largest float32: a feature or label is stored as float32


def reason(rule: str, column: str) -> str:
    """The SQL literal of a reason naming a column, e.g. 'non_finite:price-usd'."""
    return quote_string(f"{rule}:{column}")


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


__all__ = ["FLOAT_MAX", "array_reasons", "array_value", "numeric_reasons", "numeric_value", "reason"]
