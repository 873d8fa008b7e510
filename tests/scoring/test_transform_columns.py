"""``FeatureSpec.transform`` works on whole columns (Arrow compute, one reshape per array column);
its output must be, to the bit, what the row-by-row preprocessing gives: the reference below is
that preprocessing written one value at a time, the way serving did it before. Both inputs a user
or the scoring job passes are covered: an Arrow table as scoring's mapInArrow gets it (double,
string and list<float> columns, several chunks, sliced), and a pandas frame as ``predict`` gets it
(object strings with None / NaN / pd.NA, integer and boolean categories, lists and numpy rows)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from common.features import FeatureSpec
from common.features.categorical import NULL_INDEX, UNSEEN_INDEX, Categorical

pytestmark = pytest.mark.stack

VOCAB = ["paris", "", "Zürich", "東京", "😀", "3", "true", "a b"]
SPEC = FeatureSpec({
    "numeric": [{"name": "x", "mean": 0.3, "std": 1.7, "fill": 0.3},
                {"name": "y", "mean": -1e10, "std": 3e-5, "fill": 7.0}],
    "categorical": [{"name": "city", "vocab": VOCAB}, {"name": "code", "vocab": ["3", "7", "true", "false"]}],
    "arrays": [{"name": "img", "shape": [2, 3]}],
})
F32_MAX = float(np.finfo(np.float32).max)
NUMBERS = [1.5, None, math.nan, math.inf, -math.inf, 0.0, -0.0, 1e308, -1e308, 5e-324, F32_MAX, 2 * F32_MAX,
           -123456789.123456789, 1e-40, 3.0, 0.1]
CITIES = ["paris", None, "", "Zürich", "zürich", "東京", "😀", "e\u0301", "3", "true", "a b", "a  b", " paris",
          "atlantis", "", None]
CODES = ["3", "7", None, "true", "false", "3.0", "", "x", "7", None, "TRUE", "3", "false", "8", "7", "3"]


def image_rows(n: int) -> list:
    """Rows of 6 floats: ordinary, extreme finite, NaN / inf and null elements."""
    special = [F32_MAX, -F32_MAX, 1e-45, math.nan, math.inf, None]
    return [[float(i), -0.0, special[i % 6], 0.1 * i, 1e30 * (i - 8), None if i % 5 == 0 else 2.5] for i in range(n)]


def reference(frame: pd.DataFrame) -> dict:
    """The row-by-row preprocessing: each value on its own, in float64 then rounded once to float32;
    each category looked up in a dictionary by its string form."""
    numeric = []
    for row in frame.itertuples(index=False):
        out = []
        for stats in SPEC.by_kind()["numeric"]:
            name = stats["name"]
            value = getattr(row, name)
            value = math.nan if value is None else float(value)
            if not math.isfinite(value):
                value = stats["fill"]
            with np.errstate(over="ignore"):  # beyond float32 rounds to inf, as the shard job stores it
                out.append(np.float32((value - stats["mean"]) / stats["std"]))
        numeric.append(out)
    categorical = [[category_code(name, getattr(row, name)) for name in SPEC.of(Categorical).names]
                   for row in frame.itertuples(index=False)]
    img = [np.asarray(v, dtype=np.float32).reshape(2, 3) for v in frame["img"]]
    return {"numeric": np.array(numeric, dtype=np.float32).reshape(len(frame), 2),
            "categorical": np.array(categorical, dtype=np.int64).reshape(len(frame), 2),
            "img": np.stack(img) if img else np.zeros((0, 2, 3), dtype=np.float32)}


def category_code(name: str, value) -> int:
    codes = {v: i + 2 for i, v in enumerate(next(f["vocab"] for f in SPEC.by_kind()["categorical"] if f["name"] == name))}
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return NULL_INDEX
    if isinstance(value, (bool, np.bool_)):
        value = "true" if value else "false"
    if str(value) in codes:
        return codes[str(value)]
    if isinstance(value, (float, np.floating)) and float(value).is_integer() and str(int(value)) in codes:
        return codes[str(int(value))]
    return UNSEEN_INDEX


def assert_same_bits(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape, key
        assert got[key].tobytes() == want[key].tobytes(), key  # bit for bit: -0.0, NaN and rounding included


def raw_frame() -> pd.DataFrame:
    n = len(NUMBERS)
    return pd.DataFrame({"x": pd.Series(NUMBERS, dtype=object), "y": pd.Series(NUMBERS[::-1], dtype=object),
                         "city": pd.Series(CITIES, dtype=object), "code": pd.Series(CODES, dtype=object),
                         "img": pd.Series(image_rows(n), dtype=object)})


def spark_batch(frame: pd.DataFrame) -> pa.Table:
    """The frame typed as scoring's SQL types it (double, string, array<float>), in two chunks."""
    def column(name, typ):
        values = frame[name].tolist()
        return pa.chunked_array([pa.array(values[:5], type=typ), pa.array(values[5:], type=typ)])

    return pa.table({"x": column("x", pa.float64()), "y": column("y", pa.float64()),
                     "city": column("city", pa.string()), "code": column("code", pa.string()),
                     "img": column("img", pa.list_(pa.float32()))})


def test_the_reference_itself_sees_every_case():
    want = reference(raw_frame())
    assert {NULL_INDEX, UNSEEN_INDEX} <= set(want["categorical"].ravel().tolist())
    assert len(set(want["categorical"][:, 0].tolist())) >= 8  # most of the vocabulary is hit
    assert np.isnan(want["img"]).any() and np.isinf(want["img"]).any()
    assert np.isinf(want["numeric"]).any()  # beyond float32 after standardizing: rounds to inf, as before


def test_arrow_columns_equal_the_row_by_row_reference_to_the_bit():
    frame = raw_frame()
    table = spark_batch(frame)
    assert_same_bits(SPEC.transform(table), reference(frame))
    # A slice (offsets not at 0, as a filtered batch can have) and an empty batch.
    assert_same_bits(SPEC.transform(table.slice(3, 9)), reference(frame.iloc[3:12].reset_index(drop=True)))
    assert_same_bits(SPEC.transform(table.slice(0, 0)), reference(frame.iloc[:0]))


def test_arrow_columns_of_other_types_convert_as_their_pandas_values_do():
    frame = raw_frame()
    table = spark_batch(frame)
    n = len(frame)
    ints = pa.array([None if i % 4 == 0 else (2 ** 60 + i) * (-1) ** i for i in range(n)], type=pa.int64())
    fixed = pa.FixedSizeListArray.from_arrays(pa.array(np.arange(n * 6, dtype=np.int32)), 6)
    table = table.set_column(0, "x", ints).set_column(4, "img", fixed)
    frame = frame.assign(x=ints.to_pandas(), img=list(np.arange(n * 6).reshape(n, 6)))
    assert_same_bits(SPEC.transform(table), reference(frame))


def test_pandas_columns_equal_the_row_by_row_reference_to_the_bit():
    frame = raw_frame()
    assert_same_bits(SPEC.transform(frame), reference(frame))
    # numpy rows (what pandas.read_parquet gives), floats for numbers, pandas' own string dtype with
    # pd.NA, and categories that are not strings: ints, floats with a null, booleans.
    n = len(frame)
    typed = frame.assign(x=pd.Series(NUMBERS, dtype=object).astype(float),
                         img=[np.asarray(v, dtype=np.float64) for v in image_rows(n)])
    # (pandas 3 infers its own string dtype for the unannotated column of strings.)
    for code in (pd.Series([3, 7, 8, 3] * 4, dtype=object), pd.Series([3.0, math.nan, 7.0, 2.5] * 4),
                 pd.Series([True, False, None, True] * 4, dtype=object), pd.Series(["3", None, "true", "7"] * 4),
                 pd.Series(["3", None, "true", "7"] * 4, dtype="string"), pd.Series(["3", 7, None, "false"] * 4)):
        case = typed.assign(code=code)
        assert_same_bits(SPEC.transform(case), reference(case))
    assert_same_bits(SPEC.transform(typed.iloc[:0]), reference(typed.iloc[:0]))


@pytest.mark.parametrize("bad", [None, [1.0, 2.0]])
def test_an_array_row_that_is_missing_or_of_another_length_still_fails(bad):
    frame = raw_frame()
    frame.at[4, "img"] = bad
    for given in (frame, spark_batch(frame)):
        with pytest.raises(ValueError, match="reshape"):
            SPEC.transform(given)
