"""FeatureSpec.transform: serving applies exactly the preprocessing the shard job stored, on raw
pandas rows (the values Spark saw, in the types pandas gives them)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from pipelines.errors import DatasetError
from pipelines.manifest import NULL_INDEX, UNSEEN_INDEX, FeatureSpec

SPEC = FeatureSpec({
    "numeric": [{"name": "x", "mean": 2.0, "std": 4.0, "fill": 2.0}],
    # Spark casts categoricals to string before fitting: ints -> "3", booleans -> "true"
    "categorical": [{"name": "n", "vocab": ["3", "7"]}, {"name": "flag", "vocab": ["true", "false"]},
                    {"name": "city", "vocab": ["paris", "oslo"]}],
    "arrays": [{"name": "img", "shape": [2, 2]}],
})


def test_transform_matches_the_stored_encodings():
    frame = pd.DataFrame({
        "x": [6.0, None, np.nan],
        "n": [7.0, np.nan, 3.0],           # ints with a null arrive from pandas as floats
        "flag": [True, False, None],
        "city": ["oslo", "rome", None],
        "img": [[1, 2, 3, 4], [0, 0, 0, 0], [4, 3, 2, 1]],
    })
    out = SPEC.transform(frame)
    np.testing.assert_allclose(out["numeric"][:, 0], [1.0, 0.0, 0.0])  # (6-2)/4; nulls/NaN -> fill -> 0
    first = 2  # vocabulary indices start after the reserved null/unseen indices
    assert out["categorical"].tolist() == [
        [first + 1, first + 0, first + 1],
        [NULL_INDEX, first + 1, UNSEEN_INDEX],
        [first + 0, NULL_INDEX, NULL_INDEX],
    ]
    assert out["img"].shape == (3, 2, 2) and out["img"].dtype == np.float32
    assert out["img"][2].tolist() == [[4, 3], [2, 1]]


def test_missing_feature_column_is_named():
    with pytest.raises(DatasetError, match=r"missing feature column\(s\) \['img'\]"):
        SPEC.transform(pd.DataFrame({"x": [1.0], "n": [3], "flag": [True], "city": ["oslo"]}))
