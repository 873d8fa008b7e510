"""The shard job on local Spark: every rule of issue 3, checked on what a user (and training) reads.

Marked ``stack`` (run on the current profile too, Makefile STACK_TESTS): the tests whose outcome
rests on Spark's or pyarrow's behaviour (parsing, casts, SQL, aggregations, sort order, Parquet
encodings and bytes). Not marked: those of our own arithmetic and checks (balance, refusals,
modes, the quality gate, the staging check, temporaries), which the same Python decides on both."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from common.config import from_dict
from common.errors import InputDataError, OutputExistsError, QualityGateError
from pipelines.generate import generate_dataset
from common.dataset import read_manifest
from pipelines.shard_config import ShardConfig
from pipelines.shard_job import run_shard_job
from shard_testdata import (config, file_hashes, manifest_without_timestamps, quarantine, read_split, simple_rows,
                            write_parquet)

pytestmark = [pytest.mark.spark]


@pytest.fixture(scope="module")
def generated(generated_dataset):
    """3000 generated rows (array column, 3 classes, 40 bad rows) and one shard run over them: the
    session's (tests/conftest.py), which other files read too; tests here that change its config put
    it back."""
    return generated_dataset


@pytest.mark.stack
def test_manifest_is_valid_and_shards_are_balanced(generated):
    data, cfg, result = generated
    manifest = read_manifest(result.uri)
    assert not result.skipped and manifest.split_names == ["train", "val", "test"]
    for split in manifest.split_names:
        files = manifest.files(split)
        assert [f.path for f in files] == [f"{split}/part-{s:05d}.parquet" for s in range(3)]
        sizes = [f.rows for f in files]
        assert max(sizes) - min(sizes) <= 1 and sum(sizes) == manifest.rows(split)
        for f in files:
            meta = pq.ParquetFile(os.path.join(result.uri, f.path)).metadata
            assert meta.num_rows == f.rows
            assert [meta.row_group(i).num_rows for i in range(meta.num_row_groups)] == list(f.row_groups)
            assert all(g == 300 for g in f.row_groups[:-1]) and 0 < f.row_groups[-1] <= 300
            assert os.path.getsize(os.path.join(result.uri, f.path)) == f.bytes


@pytest.mark.stack
def test_row_index_and_stored_encodings(generated):
    data, cfg, result = generated
    manifest = read_manifest(result.uri)
    for split in manifest.split_names:
        table = read_split(result.uri, split)
        assert table.column("_row").to_pylist() == list(range(manifest.rows(split)))
        assert table.schema.field("x0").type == pa.float32()
        assert table.schema.field("c0").type == pa.int32()
        assert table.schema.field("label").type == pa.int64()
        assert table.schema.field("image").type.value_type == pa.float32()
        assert set(len(v) for v in table.column("image").to_pylist()) == {6}
        labels = np.asarray(table.column("label"))
        assert labels.min() >= 0 and labels.max() < 3
        for name in data.categorical:
            idx = np.asarray(table.column(name))
            assert idx.min() >= 0 and idx.max() < manifest.features.kind_of(name).num_embeddings(name)
    assert [c["name"] for c in manifest.data["schema"]] == ["x0", "x1", "x2", "x3", "id", "c0", "c1", "image",
                                                            "label", "_row"]
    train = read_split(result.uri, "train")
    counts = np.bincount(np.asarray(train.column("label")), minlength=3).tolist()
    assert list(manifest.label.train_class_counts) == counts


@pytest.mark.stack
def test_each_column_is_encoded_for_what_it_holds_and_spark_reads_it_back(generated, spark):
    # Floats plain (a dictionary of continuous values only fills and falls back), `_row` delta
    # encoded (it rises by one), codes and labels dictionary encoded: pipelines/shard_writer.py.
    data, cfg, result = generated
    manifest = read_manifest(result.uri)
    path = os.path.join(result.uri, manifest.files("train")[0].path)
    group = pq.ParquetFile(path).metadata.row_group(0)
    encodings = {group.column(i).path_in_schema: set(group.column(i).encodings) for i in range(group.num_columns)}
    dictionary = {"PLAIN_DICTIONARY", "RLE_DICTIONARY"}
    for name in ["x0", "id", "image.list.element"]:
        assert not encodings[name] & dictionary, (name, encodings[name])
    for name in ["c0", "label"]:
        assert encodings[name] & dictionary, (name, encodings[name])
    assert "DELTA_BINARY_PACKED" in encodings["_row"]
    # Continuous floats do not compress, so they are stored uncompressed; the rest is snappy.
    compression = {group.column(i).path_in_schema: group.column(i).compression for i in range(group.num_columns)}
    assert compression["x0"] == "UNCOMPRESSED"
    for name in ["c0", "label", "_row"]:
        assert compression[name] == "SNAPPY", (name, compression[name])
    # Spark's vectorized reader (the score job's dataset input) reads the delta-encoded column.
    rows = manifest.rows("train")
    total = spark.read.parquet(os.path.join(result.uri, "train")).selectExpr("sum(_row)").first()[0]
    assert total == rows * (rows - 1) // 2


@pytest.mark.stack
def test_float_columns_keep_snappy_where_it_pays():
    """The writer's per-column compression: a float column snappy shrinks (few distinct values,
    mostly zeros) keeps it, a continuous one is stored uncompressed; non-floats always snappy."""
    import numpy as np
    import pyarrow as pa

    from pipelines.shard_writer import COMPRESSION_SAMPLE_ROWS, writer_options

    rng = np.random.default_rng(3)
    n = COMPRESSION_SAMPLE_ROWS
    sparse = np.where(rng.random(n * 4) < 0.9, 0.0, rng.random(n * 4)).astype(np.float32)
    table = pa.table({
        "continuous": rng.standard_normal(n).astype(np.float32),
        "binary": rng.integers(0, 2, n).astype(np.float32),
        "image": pa.FixedSizeListArray.from_arrays(pa.array(sparse), 4).cast(pa.list_(pa.float32())),
        "noise": pa.FixedSizeListArray.from_arrays(pa.array(rng.standard_normal(n * 4).astype(np.float32)), 4)
        .cast(pa.list_(pa.float32())),
        "code": rng.integers(0, 1000, n).astype(np.int32),
    })
    assert writer_options(table.schema, table)["compression"] == {
        "continuous": "NONE", "binary": "snappy", "image": "snappy", "noise": "NONE", "code": "snappy"}
    assert writer_options(table.schema)["compression"] == "snappy"  # no sample (an empty file): snappy


def ids_of(uri: str, split: str) -> np.ndarray:
    """The raw ids of a split's rows: id is also a numeric feature, whose standardized value decodes back."""
    stats = next(f for f in read_manifest(uri).features.by_kind()["numeric"] if f["name"] == "id")
    z = np.asarray(read_split(uri, split).column("id"), dtype=np.float64)
    return np.rint(z * stats["std"] + stats["mean"]).astype(np.int64)


@pytest.mark.stack
def test_preprocessing_is_fitted_on_train_only(generated, spark):
    data, cfg, result = generated
    manifest = read_manifest(result.uri)
    stats = {f["name"]: f for f in manifest.features.by_kind()["numeric"]}
    raw = pq.read_table(data.path).to_pandas().set_index("id")
    train_ids = ids_of(result.uri, "train")
    assert len(set(train_ids)) == len(train_ids)
    train_raw = raw.loc[train_ids]
    assert stats["x1"]["mean"] == pytest.approx(train_raw["x1"].mean(), rel=1e-9)
    assert stats["x1"]["std"] == pytest.approx(train_raw["x1"].std(ddof=0), rel=1e-9)
    assert stats["x1"]["mean"] != pytest.approx(raw["x1"].mean(), rel=1e-9)  # not the whole input's
    vocab = next(f for f in manifest.features.by_kind()["categorical"] if f["name"] == "c0")["vocab"]
    freq = train_raw["c0"].value_counts()
    expected = sorted(freq.index, key=lambda v: (-freq[v], v))
    assert vocab == expected
    # Stored values equal the manifest's transform of the raw rows (what serving will do).
    table = read_split(result.uri, "train").to_pandas()
    encoded = manifest.features.transform(train_raw.reset_index())
    # Exactly: both are FeatureSpec's encodings (the shard writer and serving share them).
    np.testing.assert_array_equal(table[data.numeric].to_numpy(), encoded["numeric"][:, :4])
    np.testing.assert_array_equal(table[data.categorical].to_numpy(), encoded["categorical"])
    # Splits are disjoint and, with the quarantine, cover the input.
    all_ids = np.concatenate([ids_of(result.uri, s) for s in manifest.split_names])
    assert len(set(all_ids)) == len(all_ids) == manifest.data["accounting"]["published_rows"]


@pytest.mark.stack
def test_each_features_null_share_on_train_is_in_the_manifest(generated):
    """What a score job compares its input with: each feature's nulls over the train split's rows,
    exactly (the raw rows of the published train ids), an array's 0 (a null array is quarantined)."""
    data, cfg, result = generated
    manifest = read_manifest(result.uri)
    train = pq.read_table(data.path).to_pandas().set_index("id").loc[ids_of(result.uri, "train")]
    nulls = {name: int(train[name].isna().sum()) for name in [*data.numeric, *data.categorical]}
    assert all(nulls.values())  # every generated feature has nulls on train
    want = {**{name: n / len(train) for name, n in nulls.items()}, "id": 0.0, "image": 0.0}
    assert manifest.features.null_shares == want


@pytest.mark.stack
def test_vocabularies_too_wide_to_count_in_a_task_come_from_spark_the_same(generated, spark, tmp_path, monkeypatch):
    # A categorical feature with more distinct values in one staging task than the scan counts is
    # ranked by Spark over the staged train rows instead: the same vocabularies and the same files.
    import pipelines.summary as summary

    data, cfg, result = generated
    monkeypatch.setattr(summary, "MAX_DISTINCT_PER_PARTITION", 3)  # the generated features have ~20 values
    wide = from_dict(ShardConfig, data.shard_config(str(tmp_path / "out"), output={"num_shards": 3, "rows_per_row_group": 300},
                                                    quality={"max_bad_fraction": 0.05},
                                                    features={"numeric": data.numeric + ["id"]}))
    run_shard_job(spark, wide)
    vocab = {f["name"]: f["vocab"] for f in read_manifest(result.uri).features.by_kind()["categorical"]}
    assert all(len(v) > 3 for v in vocab.values())
    assert {f["name"]: f["vocab"] for f in read_manifest(str(tmp_path / "out")).features.by_kind()["categorical"]} == vocab
    assert file_hashes(str(tmp_path / "out")) == file_hashes(result.uri)


@pytest.mark.stack
def test_quarantine_accounting_and_reasons(generated):
    data, cfg, result = generated
    manifest = read_manifest(result.uri)
    acc = manifest.data["accounting"]
    assert acc == {"input_rows": 3000, "published_rows": 2960, "quarantined_rows": 40}
    assert manifest.data["quarantine"]["by_reason"] == data.bad_by_reason
    bad = quarantine(result.uri)
    assert bad["reason"].value_counts().to_dict() == data.bad_by_reason
    assert all(json.loads(r)["id"] >= 0 for r in bad["raw"])  # the raw row, as JSON
    assert (Path(result.uri) / "config.yaml").exists()
    saved = from_dict(ShardConfig, yaml.safe_load((Path(result.uri) / "config.yaml").read_text()))
    assert saved == cfg


@pytest.mark.stack
def test_rerun_is_byte_identical_and_independent_of_partitioning(generated, spark, tmp_path, monkeypatch):
    data, cfg, result = generated
    # The same rows, stored as 5 files instead of 2 and in another order, sharded with another
    # shuffle partition count and 7 staging partitions per split instead of num_shards (each shard
    # then reads its rows from two or three staged files).
    again = dataclasses.replace(data, path=str(tmp_path / "raw"))
    rows = pq.read_table(data.path)
    os.makedirs(again.path)
    for i, start in enumerate(range(0, rows.num_rows, 600)):  # the last rows in the first file
        pq.write_table(rows.slice(start, 600), f"{again.path}/part-{4 - i}.parquet")
    moved = pq.read_table(again.path)
    assert len(list(Path(again.path).iterdir())) == 5 and moved.num_rows == rows.num_rows == 3000
    assert moved.column("id").to_pylist() != rows.column("id").to_pylist()
    assert sorted(moved.column("id").to_pylist()) == sorted(rows.column("id").to_pylist())
    cfg2 = from_dict(ShardConfig, again.shard_config(str(tmp_path / "out"), output={"num_shards": 3, "rows_per_row_group": 300,
                                                                                       "staging_partitions": 7},
                                                     quality={"max_bad_fraction": 0.05},
                                                     features={"numeric": data.numeric + ["id"]}))
    old = spark.conf.get("spark.sql.shuffle.partitions")
    spark.conf.set("spark.sql.shuffle.partitions", "7")
    try:
        run_shard_job(spark, cfg2)
    finally:
        spark.conf.set("spark.sql.shuffle.partitions", old)
    assert file_hashes(str(tmp_path / "out")) == file_hashes(result.uri)
    a, b = manifest_without_timestamps(result.uri), manifest_without_timestamps(str(tmp_path / "out"))
    assert a["splits"] == b["splits"] and a["features"] == b["features"] and a["fingerprint"] == b["fingerprint"]
    # And a re-run (overwrite) of the first config, through the large job's path: the fixture's job
    # was small (fewer Spark jobs and tasks: one staging partition per split, the shard files dealt
    # to `cores` tasks, the quarantine written in their job instead of its own Spark sort). Users
    # rely on the files, so both paths write the same bytes (every kind of bad row in the quarantine,
    # an array column), an equal manifest apart from timestamps, and the same config.
    from common.sources import source_fingerprint
    from pipelines import shard_placement

    assert shard_placement.JobShape.of(spark, cfg, {"raw": source_fingerprint("raw", cfg.sources["raw"])}).small
    before = manifest_without_timestamps(result.uri)
    config_before = Path(result.uri, "config.yaml").read_bytes()
    monkeypatch.setattr(shard_placement, "SMALL_INPUT_BYTES", 0)  # every input is large now
    cfg.output.mode = "overwrite"
    try:
        run_shard_job(spark, cfg)
    finally:
        cfg.output.mode = "error"
    after = manifest_without_timestamps(result.uri)
    assert after["config"]["output"].pop("mode") == "overwrite"
    before["config"]["output"].pop("mode")
    assert after == before
    assert Path(result.uri, "config.yaml").read_bytes() == config_before.replace(b"mode: error", b"mode: overwrite")
    recomputed = file_hashes(result.uri)
    listed = {f["path"]: f["sha256"] for s in before["splits"].values() for f in s["files"]}
    listed.update({f["path"]: f["sha256"] for f in before["quarantine"]["files"]})
    assert recomputed == dict(sorted(listed.items()))


def test_modes_error_and_skip_if_exists(generated, spark):
    data, cfg, result = generated
    with pytest.raises(OutputExistsError, match="output.mode=overwrite"):
        run_shard_job(spark, cfg)
    marker = Path(result.uri, "_COMMITTED")
    stamp = marker.stat().st_mtime_ns
    cfg.output.mode = "skip_if_exists"
    try:
        skipped = run_shard_job(spark, cfg)
        assert skipped.skipped and skipped.manifest.fingerprint == result.manifest.fingerprint
        assert marker.stat().st_mtime_ns == stamp
        cfg.split.seed = 99  # a different dataset is there: refuse rather than silently keep it
        with pytest.raises(OutputExistsError, match="different dataset"):
            run_shard_job(spark, cfg)
    finally:
        cfg.output.mode = "error"
        cfg.split.seed = 0


# Uneven (10 rows in 3 files) and one row per file, end to end; the sizes of every (rows, shards)
# pair up to 12 shards, and each file's block of ranks, are test_shard_balance.py's (no Spark needed),
# and the generated fixture's 3 splits of 3 files each test_manifest_is_valid_and_shards_are_balanced's.
@pytest.mark.parametrize("rows,num_shards", [(10, 3), (7, 7)])
def test_balance_property(spark, tmp_path, rows, num_shards):
    src = write_parquet(tmp_path / "in", simple_rows(rows))
    result = run_shard_job(spark, config(src, str(tmp_path / "out"), output={"num_shards": num_shards}))
    sizes = [f.rows for f in result.manifest.files("train")]
    assert len(sizes) == num_shards and sum(sizes) == rows
    assert max(sizes) - min(sizes) <= 1
    assert read_split(result.uri, "train").column("_row").to_pylist() == list(range(rows))


@pytest.mark.parametrize("query, why", [
    # A source's scan: its first rows are counted before the first pass over the input.
    (None, r"source 'raw' \(.*\) has 5 rows, fewer than output.num_shards=8"),
    # A query's table may cost a pass to count: the first pass's split counts decide.
    ("SELECT * FROM raw", r"split 'train' has 5 rows, fewer than output.num_shards=8"),
])
def test_fewer_rows_than_shards_fails_before_writing(spark, tmp_path, query, why):
    src = write_parquet(tmp_path / "in", simple_rows(5))
    out = tmp_path / "out"
    with pytest.raises(InputDataError, match=why) as err:
        run_shard_job(spark, config(src, str(out), output={"num_shards": 8}, query=query))
    assert err.value.exit_code == 2 and "lower output.num_shards to at most 5" in str(err.value)
    assert not out.exists() and not list(tmp_path.glob(".out*"))


@pytest.mark.stack
def test_every_bad_row_kind_is_quarantined_with_its_reason(spark, tmp_path):
    inf = float("inf")
    rows = simple_rows(20)
    bad = [  # (x, s, arr, y) -> expected reason
        (1.0, "1.5", [1.0, 2.0], None, "null_label"),
        (1.0, "1.5", [1.0, 2.0], 2.5, "invalid_label"),
        (1.0, "1.5", [1.0, 2.0], -1.0, "invalid_label"),
        (1.0, "1.5", [1.0, 2.0], 3.0, "invalid_label"),
        (1.0, "1.5", [1.0, 2.0], float("nan"), "invalid_label"),
        (inf, "1.5", [1.0, 2.0], 1.0, "non_finite:x"),
        (-inf, "1.5", [1.0, 2.0], 1.0, "non_finite:x"),
        (float("nan"), "1.5", [1.0, 2.0], 1.0, "non_finite:x"),
        (1.0, "1e300", [1.0, 2.0], 1.0, "non_finite:s"),  # beyond float32
        (1.0, "abc", [1.0, 2.0], 1.0, "bad_value:s"),
        (1.0, "1.5", [1.0], 1.0, "bad_shape:a"),
        (1.0, "1.5", None, 1.0, "bad_shape:a"),
        (1.0, "1.5", [1.0, float("nan")], 1.0, "non_finite:a"),
        (1.0, "1.5", [inf, 1.0], 1.0, "non_finite:a"),
        (1.0, "1.5", [1.0, -inf], 1.0, "non_finite:a"),
        (1.0, "1.5", [None, 1.0], 1.0, "non_finite:a"),
        (1.0, "1.5", [-1e39, 1.0], 1.0, "non_finite:a"),  # beyond float32
    ]
    good_nan = (None, None, [3.0, 4.0], 1.0)  # null numerics are imputed, not quarantined
    n = len(rows["id"])
    cols = {
        "id": rows["id"] + list(range(n, n + len(bad) + 1)),
        "x": rows["x"] + [b[0] for b in bad] + [good_nan[0]],
        "s": [str(i) for i in range(n)] + [b[1] for b in bad] + [good_nan[1]],
        "a": [[float(i), 1.0] for i in range(n)] + [b[2] for b in bad] + [good_nan[2]],
        "c": rows["c"] + ["k1"] * (len(bad) + 1),
        "y": [float(v) for v in rows["y"]] + [b[3] for b in bad] + [good_nan[3]],
    }
    src = write_parquet(tmp_path / "in", cols)
    cfg = config(src, str(tmp_path / "out"), features={"numeric": ["x", "s"], "categorical": ["c"], "arrays": {"a": [2]}},
                 label={"column": "y", "task": "classification", "num_classes": 3})
    result = run_shard_job(spark, cfg)
    expected = {}
    for b in bad:
        expected[b[-1]] = expected.get(b[-1], 0) + 1
    assert result.manifest.data["quarantine"]["by_reason"] == dict(sorted(expected.items()))
    assert result.manifest.data["accounting"] == {"input_rows": n + len(bad) + 1, "published_rows": n + 1,
                                                  "quarantined_rows": len(bad)}
    q = quarantine(result.uri)
    assert sorted(q["reason"]) == sorted(b[-1] for b in bad)
    row = json.loads(q[q["reason"] == "bad_value:s"]["raw"].iloc[0])
    assert row["s"] == "abc" and row["id"] == n + 9
    # The null row was imputed with the train mean (standardized: (mean - mean) / std = 0).
    table = read_split(result.uri, "train").to_pandas()
    assert np.isfinite(table["x"]).all() and np.isfinite(table["s"]).all()


@pytest.mark.stack
def test_regression_label_rules_and_stats(spark, tmp_path):
    rows = simple_rows(30)
    ys = [float(i) for i in range(30)] + [None, float("inf"), float("nan")]
    cols = {"id": list(range(33)), "x": rows["x"] + [1.0] * 3, "c": rows["c"] + ["k1"] * 3, "y": ys}
    src = write_parquet(tmp_path / "in", cols)
    result = run_shard_job(spark, config(src, str(tmp_path / "out"), label={"column": "y", "task": "regression",
                                                                            "num_classes": None}))
    m = result.manifest
    assert m.data["quarantine"]["by_reason"] == {"invalid_label": 2, "null_label": 1}
    assert m.label.train_mean == pytest.approx(14.5) and m.label.train_std == pytest.approx(np.std(range(30)))
    assert m.column("label")["dtype"] == "float32"
    assert read_split(result.uri, "train").schema.field("label").type == pa.float32()


@pytest.mark.stack
@pytest.mark.parametrize("fmt", ["csv", "json"])
def test_malformed_records_keep_their_raw_line(spark, tmp_path, fmt):
    src = tmp_path / "in"
    src.mkdir()
    if fmt == "csv":
        good = [f"{i},{i % 7}.5,k{i % 3},{i % 2}" for i in range(12)]
        bad = ["12,not-a-number,k1,1", "13,2.0,k1,notint"]
        (src / "data.csv").write_text("id,x,c,y\n" + "\n".join(good[:6] + bad + good[6:]) + "\n")
        options = {"header": True}
    else:
        good = [json.dumps({"id": i, "x": i % 7 + 0.5, "c": f"k{i % 3}", "y": i % 2}) for i in range(12)]
        bad = ['{"id": 12, "x": 1.0, "c": "k1", "y": ', '{"id": 13, "x": "text", "c": "k1", "y": 1}']
        (src / "data.json").write_text("\n".join(good[:6] + bad + good[6:]) + "\n")
        options = {}
    cfg = config(str(src), str(tmp_path / "out"), fmt=fmt,
                 sources={"raw": {"path": str(src), "format": fmt, "options": options,
                                  "schema": "id BIGINT, x DOUBLE, c STRING, y INT"}})
    result = run_shard_job(spark, cfg)
    m = result.manifest
    assert m.data["quarantine"]["by_reason"] == {"malformed_record": 2}
    assert m.data["accounting"] == {"input_rows": 14, "published_rows": 12, "quarantined_rows": 2}
    q = quarantine(result.uri)
    assert sorted(q["raw"]) == sorted(bad)
    assert set(q["source"]) == {"raw"}


@pytest.mark.stack
def test_malformed_value_in_an_unused_column_is_still_detected(spark, tmp_path):
    # Spark parses only the columns a query uses; the job must not let that change what is malformed.
    src = tmp_path / "in"
    src.mkdir()
    lines = [f"{i},{i}.0,k1,{i % 2},{i}" for i in range(10)] + ["10,1.0,k1,1,not-a-number"]
    (src / "d.csv").write_text("id,x,c,y,unused\n" + "\n".join(lines) + "\n")
    cfg = config(str(src), str(tmp_path / "out"), fmt="csv",
                 sources={"raw": {"path": str(src), "format": "csv", "options": {"header": True},
                                  "schema": "id BIGINT, x DOUBLE, c STRING, y INT, unused DOUBLE"}})
    m = run_shard_job(spark, cfg).manifest
    assert m.data["accounting"] == {"input_rows": 11, "published_rows": 10, "quarantined_rows": 1}


def test_missing_column_fails_before_writing_naming_column_and_source(spark, tmp_path):
    src = write_parquet(tmp_path / "in", simple_rows(10))
    out = tmp_path / "out"
    with pytest.raises(InputDataError, match=r"column 'z' \(features.numeric\) is not in source 'raw' \(.*in\)"):
        run_shard_job(spark, config(src, str(out), features={"numeric": ["x", "z"]}))
    assert not out.exists() and not list(tmp_path.glob(".out*"))


@pytest.mark.stack
def test_uncastable_type_fails_before_writing(spark, tmp_path):
    cols = {**simple_rows(10), "m": [[1.0, 2.0]] * 10}
    src = write_parquet(tmp_path / "in", cols)
    out = tmp_path / "out"
    with pytest.raises(InputDataError, match=r"column 'm' \(features.numeric\).*array<double>.*cannot be cast"):
        run_shard_job(spark, config(src, str(out), features={"numeric": ["x", "m"]}))
    with pytest.raises(InputDataError, match=r"column 'x' \(features.arrays.x\).*double"):
        run_shard_job(spark, config(src, str(out), features={"numeric": [], "categorical": ["c"], "arrays": {"x": [1]}}))
    assert not out.exists()


def test_quality_gate_reports_counts_by_reason_and_writes_nothing(spark, tmp_path):
    cols = simple_rows(20)
    cols["y"] = [None] * 3 + [5] * 2 + cols["y"][5:]
    src = write_parquet(tmp_path / "in", cols)
    out = tmp_path / "out"
    with pytest.raises(QualityGateError, match=r"5 of 20 input rows \(25.00%\).*null_label=3, invalid_label=2"):
        run_shard_job(spark, config(src, str(out), quality={"max_bad_fraction": 0.1}))
    assert not out.exists() and not list(tmp_path.glob(".out*"))


@pytest.mark.stack
def test_query_over_two_sources_and_a_transform(spark, tmp_path):
    a = write_parquet(tmp_path / "a", simple_rows(40))
    b = write_parquet(tmp_path / "b", {"id": list(range(40)), "extra": [float(i) * 2 for i in range(40)]})
    cfg = config(a, str(tmp_path / "out"),
                 sources={"events": {"path": a}, "users": {"path": b}},
                 query="SELECT e.*, u.extra FROM events e JOIN users u ON e.id = u.id WHERE e.id < 30",
                 transform="shard_transforms:add_ratio",
                 features={"numeric": ["x", "extra", "ratio"], "categorical": ["c"]},
                 split={"key": "id", "fractions": {"train": 0.5, "val": 0.5}, "seed": 1})
    result = run_shard_job(spark, cfg)
    m = result.manifest
    assert m.rows("train") + m.rows("val") == 30
    assert [f["name"] for f in m.features.by_kind()["numeric"]] == ["x", "extra", "ratio"]


@pytest.mark.stack
def test_label_expr_and_bad_expressions(spark, tmp_path):
    src = write_parquet(tmp_path / "in", simple_rows(20))
    result = run_shard_job(spark, config(src, str(tmp_path / "out"),
                                         label={"column": None, "expr": "CAST(x > 8 AS INT)", "num_classes": 2}))
    assert sum(result.manifest.label.train_class_counts) == 20
    with pytest.raises(InputDataError, match="split.key 'nope' is not a column or valid expression"):
        run_shard_job(spark, config(src, str(tmp_path / "out2"), split={"key": "nope"}))


def test_duplicate_rows_and_grouped_keys_still_give_identical_files(spark, tmp_path):
    # Rows that tie on the shuffle order are identical rows, so their order cannot change a byte.
    rows = simple_rows(30)
    dup = {k: v * 3 for k, v in rows.items()}
    one = write_parquet(tmp_path / "one", dup)
    many = tmp_path / "many"
    many.mkdir()
    for i in range(3):
        pq.write_table(pa.table({k: v[i * 30:(i + 1) * 30] for k, v in dup.items()}), many / f"p{i}.parquet")
    split = {"key": "id", "fractions": {"train": 0.7, "val": 0.3}, "seed": 4}
    a = run_shard_job(spark, config(one, str(tmp_path / "a"), split=split, output={"num_shards": 3}))
    b = run_shard_job(spark, config(str(many), str(tmp_path / "b"), split=split, output={"num_shards": 3}))
    assert file_hashes(a.uri) == file_hashes(b.uri)
    assert a.manifest.rows("train") % 3 == 0 and a.manifest.rows("val") % 3 == 0  # a key's rows stay together


@pytest.mark.stack
def test_csv_without_a_schema_parses_strings_and_names_bad_values(spark, tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    lines = [f"{i},{i % 5}.25,k{i % 2},{i % 2}" for i in range(12)] + ["12,abc,k1,1"]
    (src / "d.csv").write_text("id,x,c,y\n" + "\n".join(lines) + "\n")
    cfg = config(str(src), str(tmp_path / "out"), fmt="csv",
                 sources={"raw": {"path": str(src), "format": "csv", "options": {"header": True}}})
    m = run_shard_job(spark, cfg).manifest  # every column inferred as a string: values are parsed per row
    assert m.data["quarantine"]["by_reason"] == {"bad_value:x": 1}
    assert m.data["accounting"]["published_rows"] == 12
    with pytest.raises(InputDataError, match=r"source 'raw': path .*nowhere does not exist \(sources.raw.path\)"):
        run_shard_job(spark, config(str(tmp_path / "nowhere"), str(tmp_path / "out2")))


# A shard writer (pipelines.shard_writer._write_file, through its atomic file) in its own process,
# fed one 1,000-row table every 50 ms so that a test can kill it in the middle of the file.
_SLOW_WRITER = """
import sys, time
import pyarrow as pa
from common.storage import resolve
from pipelines.shard_writer import _write_file

schema = pa.schema([pa.field("x", pa.float64(), nullable=False)])

def tables():
    for i in range(100_000):
        yield pa.table({"x": pa.array([float(i)] * 1000)}, schema=schema)
        time.sleep(0.05)

_write_file(tables(), resolve(sys.argv[1]), "train/part-00000.parquet", schema, 1000)
"""


@pytest.mark.process
def test_temporaries_of_a_killed_writer_are_not_published(tmp_path):
    # A write attempt killed mid-file (here: SIGKILL to a real writer process) leaves
    # `<file>.tmp-<id>` and no file; the job removes such leftovers from the staging directory
    # before it commits, so a retry's file is published alone.
    import signal
    import subprocess
    import sys

    from common.storage import resolve
    from pipelines.shard_job import _remove_temporaries
    from polling import wait_for

    root = Path(__file__).resolve().parents[2]
    writer = subprocess.Popen([sys.executable, "-c", _SLOW_WRITER, str(tmp_path)], cwd=root,
                              env={**os.environ, "PYTHONPATH": str(root)}, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: [p for p in (tmp_path / "train").glob("part-00000.parquet.tmp-*") if p.stat().st_size > 4096],
                 "the writer to write a row group", timeout=120, proc=writer)
        os.kill(writer.pid, signal.SIGKILL)
        assert writer.wait(timeout=30) == -signal.SIGKILL  # it died by the signal, mid-file
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    left = sorted(p.name for p in (tmp_path / "train").iterdir())
    assert len(left) == 1 and left[0].startswith("part-00000.parquet.tmp-")  # the half-written file, no final one
    (tmp_path / "train" / "part-00000.parquet").write_bytes(b"the retry's file")
    _remove_temporaries(resolve(str(tmp_path)), ["train", "val", "_quarantine"])
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["part-00000.parquet"]


def test_staged_rows_that_change_between_the_passes_fail_the_job_and_publish_nothing(spark, tmp_path, monkeypatch):
    # Pass two checks the rows it reads from the staging files against pass one's counts: a
    # staging file that lost rows in between (another process, a broken disk) fails the job.
    from common.errors import SparkJobError
    from common.storage import resolve
    from pipelines import shard_job

    src = write_parquet(tmp_path / "in", simple_rows(300))
    out = tmp_path / "out"
    damaged = []
    original = shard_job._write_shards

    def damage_then_write(spark_, staged, *args, **kwargs):
        path = resolve(staged.uri).join(staged.split_paths(0)[0]).path
        table = pq.read_table(path)
        pq.write_table(table.slice(0, table.num_rows - 1), path)
        damaged.append((table.num_rows, pq.read_metadata(path).num_rows))
        return original(spark_, staged, *args, **kwargs)

    monkeypatch.setattr(shard_job, "_write_shards", damage_then_write)
    with pytest.raises(SparkJobError, match=r"the staging directory changed while the job ran, nothing was published"):
        run_shard_job(spark, config(src, str(out)))
    assert damaged and damaged[0][1] == damaged[0][0] - 1  # the staged file did lose a row
    assert not out.exists() and not list(tmp_path.glob(".out*"))


@pytest.mark.stack
# Parquet (with an array column): the generated fixture's small job against the large path in
# test_rerun_is_byte_identical_and_independent_of_partitioning.
@pytest.mark.parametrize("fmt", ["csv"])
def test_a_small_job_writes_the_bytes_of_a_large_one(spark, tmp_path, monkeypatch, fmt):
    # Sources under SMALL_INPUT_BYTES run in fewer Spark jobs and tasks (one staging partition
    # per split, the shard files dealt to `cores` tasks, the quarantine written in their job
    # instead of its own Spark sort). Users rely on the files, so they must be the bytes the
    # large job's path writes for the same rows: quarantine (every kind of bad row, malformed
    # records among them for CSV), shards, manifest and config.
    from common.sources import source_fingerprint
    from pipelines import shard_placement

    data = generate_dataset(spark, str(tmp_path / "raw"), 2000, seed=3, format=fmt, bad_rows=25,
                            array_shape=[3] if fmt == "parquet" else None)
    cfg = from_dict(ShardConfig, data.shard_config(str(tmp_path / "out"), output={"num_shards": 3},
                                                   quality={"max_bad_fraction": 0.05}))
    assert shard_placement.JobShape.of(spark, cfg, {"raw": source_fingerprint("raw", cfg.sources["raw"])}).small
    small = run_shard_job(spark, cfg)
    small_files, small_manifest = file_hashes(small.uri), manifest_without_timestamps(small.uri)
    small_config = Path(small.uri, "config.yaml").read_bytes()
    assert len(quarantine(small.uri)) == 25 and small.manifest.data["quarantine"]["by_reason"] == data.bad_by_reason

    monkeypatch.setattr(shard_placement, "SMALL_INPUT_BYTES", 0)  # every input is large now
    cfg.output.mode = "overwrite"
    large = run_shard_job(spark, cfg)
    assert file_hashes(large.uri) == small_files
    large_manifest = manifest_without_timestamps(large.uri)
    assert large_manifest["config"]["output"].pop("mode") == "overwrite"
    small_manifest["config"]["output"].pop("mode")
    assert large_manifest == small_manifest
    assert Path(large.uri, "config.yaml").read_bytes() == small_config.replace(b"mode: error", b"mode: overwrite")


@pytest.mark.parametrize("small", [True, False])
def test_fewer_rows_than_shards_is_the_same_refusal_however_the_job_runs(spark, tmp_path, monkeypatch, small):
    # A small job counts its rows in its first pass instead of a Spark job of its own: the same
    # error, before anything is published, and it comes before the quality gate (3 of 5 bad rows).
    from pipelines import shard_placement

    if not small:
        monkeypatch.setattr(shard_placement, "SMALL_INPUT_BYTES", 0)
    rows = simple_rows(5)
    rows["y"] = [0, 1, None, None, None]
    src = write_parquet(tmp_path / "in", rows)
    out = tmp_path / "out"
    with pytest.raises(InputDataError, match=r"source 'raw' \(.*\) has 5 rows, fewer than output.num_shards=8"):
        run_shard_job(spark, config(src, str(out), output={"num_shards": 8}, quality={"max_bad_fraction": 0.1}))
    assert not out.exists() and not list(tmp_path.glob(".out*"))
