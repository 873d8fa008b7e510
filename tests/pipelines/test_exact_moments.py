"""The train statistics' exact moments (pipelines.summary.exact_moments) on real Spark: awkward doubles
(subnormal, huge, powers of two and their neighbours, mixed signs, zeros, nulls) give the
correctly rounded mean and sum of squared deviations, the same bits on any partitioning."""

from __future__ import annotations

import math
import random
import struct
from fractions import Fraction

import pytest

from pipelines.summary import exact_moments

pytestmark = [pytest.mark.spark, pytest.mark.stack]


def _awkward_values() -> list[float | None]:
    rng = random.Random(11)
    values = [0.0, -0.0, 5e-324, -5e-324, 2.2250738585072014e-308, 2.225073858507201e-308, 1.7976931348623157e308,
              -1.7976931348623157e308, 1.0, 2.0, 4.0, 0.5, 0.1, -0.1, None, None]
    for e in (-1022, -300, -53, -1, 0, 1, 52, 53, 300, 1023):
        p = math.ldexp(1.0, e)
        values += [p, math.nextafter(p, 0.0), math.nextafter(p, math.inf), -p]
    values += [rng.uniform(-1e6, 1e6) for _ in range(400)] + [rng.gauss(3.0, 1e-9) for _ in range(200)]
    values += [struct.unpack("<d", struct.pack("<Q", rng.getrandbits(62)))[0] for _ in range(200)]  # any exponent
    return values


def _exact(values: list[float]) -> tuple[int, float, Fraction]:
    xs = [Fraction(v) for v in values if v is not None]
    n = len(xs)
    mean = sum(xs) / n
    return n, float(mean), sum((x - mean) ** 2 for x in xs)


def test_moments_are_exact_and_independent_of_partitioning(spark):
    values = _awkward_values()
    finite_small = [v if v is None or abs(v) < 1e150 else None for v in values]  # squares stay finite
    rows = [(i, v, w, i % 3) for i, (v, w) in enumerate(zip(values, finite_small))]
    frame = spark.createDataFrame(rows, "id INT, a DOUBLE, b DOUBLE, g INT")
    results = [exact_moments(df, ["a", "b", "CAST(id AS DOUBLE)"], "g <> 2")
               for df in (frame.coalesce(1), frame.repartition(7, "id"), frame.repartition(3).sortWithinPartitions("a"))]
    assert results[0] == results[1] == results[2]  # bit-identical, not approximately equal
    kept = [r for r in rows if r[3] != 2]
    n, mean, m2 = _exact([r[1] for r in kept])
    assert results[0][0] == (n, mean, math.inf) and m2 > 1.7976931348623157e308  # m2 beyond doubles: inf, as doubles give
    for got, column in ((results[0][1], 2), (results[0][2], 0)):
        n, mean, m2 = _exact([float(r[column]) if r[column] is not None else None for r in kept])
        assert got == (n, mean, float(m2))


def test_no_rows_and_all_null_give_zero_count(spark):
    frame = spark.createDataFrame([(1, None), (2, None)], "id INT, a DOUBLE")
    assert exact_moments(frame, ["a", "CAST(id AS DOUBLE)"], "id > 5") == [(0, 0.0, 0.0), (0, 0.0, 0.0)]
    assert exact_moments(frame, ["a"], "true") == [(0, 0.0, 0.0)]
