"""FeatureSpec.transform: serving applies exactly the preprocessing the shard job stored, on raw
pandas rows (the values Spark saw, in the types pandas gives them)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from common.errors import DatasetError
from common.features import FeatureSpec
from common.features.categorical import NULL_INDEX, UNSEEN_INDEX, Categorical

# Marked stack, test by test: transform on pandas frames and Arrow columns; not the manifest's JSON.

SPEC = FeatureSpec({
    "numeric": [{"name": "x", "mean": 2.0, "std": 4.0, "fill": 2.0}],
    # Spark casts categoricals to string before fitting: ints -> "3", booleans -> "true"
    "categorical": [{"name": "n", "vocab": ["3", "7"]}, {"name": "flag", "vocab": ["true", "false"]},
                    {"name": "city", "vocab": ["paris", "oslo"]}],
    "arrays": [{"name": "img", "shape": [2, 2]}],
})


@pytest.mark.stack  # pandas' types
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


@pytest.mark.stack  # pyarrow compute
def test_arrow_strings_are_looked_up_at_once_with_the_same_codes():
    # The shard job encodes Spark's string casts as Arrow arrays (one vectorized lookup); a model
    # serving pandas rows looks them up one by one. Both must give every value the same code:
    # vocabulary values, unseen ones, nulls, the empty string and text beyond ASCII.
    import pyarrow as pa

    spec = FeatureSpec({"categorical": [{"name": "c", "vocab": ["b", "", "é", "a\ufffd", "😀"]}]})
    values = ["b", None, "", "B", "é", "e\u0301", "😀", "a\ufffd", "zz", None, "b"]
    looked_up = spec.of(Categorical).encode_column("c", pa.array(values, type=pa.string()))
    assert looked_up.tolist() == [2, NULL_INDEX, 3, UNSEEN_INDEX, 4, UNSEEN_INDEX, 6, 5, UNSEEN_INDEX, NULL_INDEX, 2]
    assert looked_up.tolist() == spec.of(Categorical).encode_column("c", pd.Series(values, dtype=object)).tolist()
    chunked = pa.chunked_array([pa.array(values[:4], type=pa.large_string()), pa.array(values[4:], type=pa.large_string())])
    assert spec.of(Categorical).encode_column("c", chunked).tolist() == looked_up.tolist()


@pytest.mark.stack  # pandas' frames
def test_missing_feature_column_is_named():
    with pytest.raises(DatasetError, match=r"missing feature column\(s\) \['img'\]"):
        SPEC.transform(pd.DataFrame({"x": [1.0], "n": [3], "flag": [True], "city": ["oslo"]}))


def _dataset(tmp_path, row_groups_per_file: list[list[int]]):
    from common.dataset import read_manifest
    from common.manifest_builder import build_manifest, write_manifest
    from common.publish import publish

    # Only the manifest matters to describe_dataset; no Parquet file is read.
    files = [{"path": f"train/part-{i:05d}.parquet", "rows": sum(g), "row_groups": g, "bytes": 1, "sha256": "0" * 64}
             for i, g in enumerate(row_groups_per_file)]
    features = {"numeric": [{"name": "x", "mean": 0.0, "std": 1.0, "fill": 0.0}], "categorical": [],
                "arrays": [{"name": "img", "shape": [8, 8]}]}
    label = {"name": "label", "task": "classification", "num_classes": 2}
    splits = {"train": {"rows": sum(f["rows"] for f in files), "files": files}}
    with publish(str(tmp_path / "ds")) as staging:
        write_manifest(staging, build_manifest(splits, features, label))
    return read_manifest(str(tmp_path / "ds"))


def test_inspect_warns_about_row_groups_too_small_for_the_loader(tmp_path):
    from pipelines.describe import describe_dataset

    # 4 + 256 + 8 + 8 = 276 bytes a row: 10,000-row groups are 2.6 MiB, 60,000-row groups 15.8 MiB
    small = describe_dataset(_dataset(tmp_path / "a", [[10_000, 10_000, 5_000]]))
    assert "row groups up to 10,000 rows = 2.6 MiB of stored data; below 8 MiB the training loader slows" in small
    large = describe_dataset(_dataset(tmp_path / "b", [[60_000, 60_000, 1]]))
    assert "row groups up to 60,000 rows = 15.8 MiB of stored data" in large and "slows" not in large
    # one row group per file: the data is simply small, nothing to change
    tiny = describe_dataset(_dataset(tmp_path / "c", [[500], [500]]))
    assert "row groups up to 500 rows" in tiny and "slows" not in tiny


def test_manifest_reader_refuses_an_unknown_dtype(tmp_path):
    """The reader validates dtypes: a benchmark once wrote "dtype": "x" and every reader accepted it."""
    import json

    from common.dataset import MANIFEST_NAME, read_manifest

    good = _dataset(tmp_path / "ok", [[10]])
    data = dict(good.data)
    data["schema"] = [dict(c, dtype="x") if c["name"] == "img" else c for c in data["schema"]]
    (tmp_path / "ok" / "ds" / MANIFEST_NAME).write_text(json.dumps(data))
    with pytest.raises(DatasetError, match=r"field 'schema\[img\]\.dtype' is 'x'; expected one of float32, int32, int64"):
        read_manifest(str(tmp_path / "ok" / "ds"))


def test_build_manifest_derives_the_schema_and_fingerprint():
    from common.manifest_builder import build_manifest, fingerprint

    features = {"numeric": [{"name": "x", "mean": 0.0, "std": 1.0, "fill": 0.0}],
                "categorical": [{"name": "c", "vocab": ["a"]}], "arrays": [{"name": "img", "shape": [2, 3]}]}
    label = {"name": "label", "task": "regression"}
    splits = {"train": {"rows": 3, "files": [{"path": "train/part-00000.parquet", "rows": 3, "row_groups": [2, 1],
                                               "bytes": 9, "sha256": "0" * 64}]}}
    m = build_manifest(splits, features, label)
    assert [(c["name"], c["dtype"], c["shape"]) for c in m["schema"]] == [
        ("x", "float32", []), ("c", "int32", []), ("img", "float32", [2, 3]), ("label", "float32", []),
        ("_row", "int64", [])]
    assert m["format_version"] == 2 and m["features"] == [  # one ordered list, each record naming its kind
        {"name": "x", "kind": "numeric", "mean": 0.0, "std": 1.0, "fill": 0.0},
        {"name": "c", "kind": "categorical", "vocab": ["a"]}, {"name": "img", "kind": "arrays", "shape": [2, 3]}]
    assert m["fingerprint"] == fingerprint(splits, m["features"], label)
    bad = {"train": {"rows": 4, "files": splits["train"]["files"]}}
    with pytest.raises(DatasetError, match=r"field 'splits.train.rows' is 4, but its files hold 3 rows"):
        build_manifest(bad, features, label)


def test_null_shares_are_optional_checked_and_no_part_of_the_encoding():
    """A feature record's null_share (the shard job's, from 0.1.x on) is a fraction in [0, 1] where
    present; a manifest without any (written before) still reads; the two encode alike."""
    from common.manifest_builder import build_manifest

    features = {"numeric": [{"name": "x", "mean": 0.0, "std": 1.0, "fill": 0.0, "null_share": 0.25}],
                "categorical": [{"name": "c", "vocab": ["a"], "null_share": 0.0}],
                "arrays": [{"name": "img", "shape": [2], "null_share": 0.0}]}
    before = {kind: [{k: v for k, v in f.items() if k != "null_share"} for f in records]
              for kind, records in features.items()}
    label = {"name": "label", "task": "regression"}
    splits = {"train": {"rows": 1, "files": [{"path": "train/part-00000.parquet", "rows": 1, "row_groups": [1],
                                               "bytes": 9, "sha256": "0" * 64}]}}
    build_manifest(splits, before, label)
    assert FeatureSpec(features).null_shares == {"x": 0.25, "c": 0.0, "img": 0.0}
    assert FeatureSpec(before).null_shares == {}
    assert FeatureSpec(features).encoding == FeatureSpec(before).encoding == FeatureSpec(before).spec
    assert FeatureSpec(features).encoding != FeatureSpec(dict(before, numeric=[dict(before["numeric"][0], std=2.0)])).encoding
    for bad in (1.5, -0.1, "0.2", True):
        features["categorical"][0]["null_share"] = bad
        with pytest.raises(DatasetError, match=rf"field 'features.categorical\[c\].null_share' is {bad!r}; expected a "
                                               r"fraction in \[0, 1\]"):
            build_manifest(splits, features, label)


def test_a_teacher_record_adds_its_column_and_is_validated():
    """The soft-target column follows the record (probabilities [num_classes], or a value), joins
    the fingerprint, and a record that does not describe its column is refused naming the field."""
    from common.dataset import validate_manifest
    from common.manifest_builder import build_manifest

    features = {"numeric": [{"name": "x", "mean": 0.0, "std": 1.0, "fill": 0.0}]}
    label = {"name": "label", "task": "classification", "num_classes": 3}
    splits = {"train": {"rows": 1, "files": [{"path": "train/part-00000.parquet", "rows": 1, "row_groups": [1],
                                               "bytes": 9, "sha256": "0" * 64}]}}
    teacher = {"uri": "s3://m/t", "fingerprint": "f" * 64, "temperature": 2.0, "column": "teacher",
               "task": "classification", "num_classes": 3, "features": {"numeric": ["x"]}}
    m = build_manifest(splits, features, label, teacher=teacher)
    assert [c["name"] for c in m["schema"]] == ["x", "label", "teacher", "_row"]
    assert m["schema"][2] == {"name": "teacher", "dtype": "float32", "shape": [3]}
    assert m["teacher"] == teacher and m["fingerprint"] != build_manifest(splits, features, label)["fingerprint"]
    regression = build_manifest(splits, features, {"name": "label", "task": "regression"},
                                teacher={**teacher, "task": "regression", "temperature": 1.0})
    assert regression["schema"][2] == {"name": "teacher", "dtype": "float32", "shape": []}
    for change, field in [({"fingerprint": ""}, "teacher.fingerprint"), ({"temperature": 0}, "teacher.temperature"),
                          ({"num_classes": 4}, "schema"), ({"column": "soft"}, "teacher.column")]:
        with pytest.raises(DatasetError, match=rf"field '{field}'"):
            validate_manifest({**m, "teacher": {**teacher, **change}}, "m.json")


def test_read_manifest_types_the_label_teacher_and_splits_and_gives_back_their_records(tmp_path):
    """The label, teacher and split entries are parsed once into frozen typed objects; a record's
    ``to_record()`` is exactly the JSON it came from (``source`` and fields a newer writer adds
    included): what model.json stores and a plug-in model factory receives."""
    import dataclasses
    import json

    from common.dataset import FileEntry, LabelSpec, read_manifest, SplitEntry
    from common.manifest_builder import build_manifest, write_manifest
    from common.publish import publish

    features = {"numeric": [{"name": "x", "mean": 0.0, "std": 1.0, "fill": 0.0}]}
    label = {"name": "label", "task": "classification", "num_classes": 3, "train_class_counts": [5, 0, 2],
             "source": "y", "added_later": {"a": [1]}}
    entry = {"path": "train/part-00000.parquet", "rows": 7, "row_groups": [4, 3], "bytes": 9, "sha256": "0" * 64}
    splits = {"train": {"rows": 7, "files": [entry]}}
    teacher = {"uri": "s3://m/t", "fingerprint": "f" * 64, "temperature": 2, "column": "teacher",
               "task": "classification", "num_classes": 3,
               "features": {"numeric": ["x"], "arrays": [{"name": "img", "shape": [2, 2]}]}}
    with publish(str(tmp_path / "ds")) as staging:
        write_manifest(staging, build_manifest(splits, features, label, teacher=teacher))
    m = read_manifest(str(tmp_path / "ds"))

    assert m.label == LabelSpec(name="label", task="classification", num_classes=3, train_class_counts=(5, 0, 2))
    assert m.label.classification and m.label.train_mean is None
    assert json.dumps(m.label.to_record()) == json.dumps(label)  # same keys, same order, same values
    m.label.to_record()["added_later"]["a"].append(2)  # a copy: the parsed label cannot be changed through it
    assert m.label.to_record() == label
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.label.task = "regression"

    t = m.teacher
    assert (t.uri, t.temperature, t.task, t.num_classes, t.shape) == ("s3://m/t", 2.0, "classification", 3, (3,))
    assert t.features == ({"name": "x", "kind": "numeric"}, {"name": "img", "kind": "arrays", "shape": [2, 2]})
    assert json.dumps(t.to_record()) == json.dumps(teacher)

    assert m.splits == {"train": SplitEntry(rows=7, files=(FileEntry(entry["path"], 7, (4, 3), 9, "0" * 64),))}
    assert (m.rows("train"), m.num_shards("train"), m.files("train")) == (7, 1, list(m.splits["train"].files))

    regression = LabelSpec.from_record({"name": "label", "task": "regression", "train_mean": 2, "train_std": 0.5})
    assert (regression.classification, regression.train_mean, regression.train_std) == (False, 2.0, 0.5)
    assert LabelSpec(name="label", task="regression", train_mean=2.0).to_record() == {
        "name": "label", "task": "regression", "train_mean": 2.0}


@pytest.mark.parametrize("content, says", [
    (b'[{"format": "shardtrain.dataset"}]', "holds a JSON list, not the manifest's object"),
    (b'{"format": ', "not valid JSON"),
    (b'{"format": "\xff\xfe"}', "not UTF-8 text (byte 12)"),
])
def test_a_manifest_of_the_wrong_shape_or_bytes_is_one_line_naming_it_with_exit_2(tmp_path, capsys, content, says):
    """`shardtrain inspect` (every reader: read_manifest) on a committed dataset whose manifest
    is a JSON list, is cut short, or holds bytes that are not UTF-8: exit 2, one line naming the file."""
    from common.dataset import MANIFEST_NAME
    from shardtrain.cli import main

    _dataset(tmp_path, [[10]])
    path = tmp_path / "ds" / MANIFEST_NAME
    path.write_bytes(content)
    assert path.read_bytes() == content  # the damage is really there
    assert main(["inspect", str(tmp_path / "ds")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"shardtrain: error: {path}: {says}"), err


def test_a_version_1_manifest_reads_as_the_version_2_manifest_of_the_same_dataset(tmp_path):
    """Datasets published before the features became one list (format_version 1: features by kind)
    still read, to the same features, stored columns and batch layout; each version's own form
    is required of it, and a record of a kind this shardtrain does not know is refused, naming it."""
    from common.dataset import MANIFEST_NAME, read_manifest

    new = _dataset(tmp_path / "v2", [[10]])
    root = tmp_path / "v2" / "ds"
    assert new.data["format_version"] == 2 and isinstance(new.data["features"], list)
    old = dict(new.data, format_version=1, features=FeatureSpec(new.data["features"]).by_kind())
    (root / MANIFEST_NAME).write_text(json.dumps(old))
    read = read_manifest(str(root))
    assert read.features.spec == new.features.spec and read.features.stored_columns() == new.features.stored_columns()
    assert read.features.batch_layout() == new.features.batch_layout() and read.data["format_version"] == 1

    for version, features, message in (
            (1, new.data["features"], r"field 'features' must be a mapping of feature records \(format_version 1\)"),
            (2, old["features"], r"field 'features' must be a list of feature records \(format_version 2\)"),
            (2, [dict(new.data["features"][0], kind="audio")], r"field 'features\[.*\]\.kind' is 'audio'; expected one of")):
        (root / MANIFEST_NAME).write_text(json.dumps(dict(new.data, format_version=version, features=features)))
        with pytest.raises(DatasetError, match=message):
            read_manifest(str(root))
