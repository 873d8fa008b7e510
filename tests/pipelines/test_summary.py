"""The shard job's one scan before placement (pipelines/summary.py) on real Spark: its counts,
class counts and vocabularies equal plain Spark aggregations of the same rows, on any
partitioning, and a feature with too many values per partition falls back to Spark's ranking
with the same result."""

from __future__ import annotations

import random

import pytest

from common.features.categorical import Categorical, top_values
from pipelines.summary import ScanSpec, summarize

pytestmark = [pytest.mark.spark, pytest.mark.stack]

SCHEMA = "s INT, b INT, r STRING, x DOUBLE, a STRING, y BIGINT"


def _rows(n: int = 3000) -> list[tuple]:
    rng = random.Random(5)
    values = ["a", "b", "Z", "é", None] + [f"rare{i}" for i in range(40)]
    weights = [30, 30, 20, 15, 5] + [1] * 40
    reasons = [None] * 20 + ["bad_shape:img", "null_label", "malformed_record"]
    rows = []
    for _ in range(n):
        x = rng.choice([None, 0.0, -0.0, 1e-310, rng.gauss(3.0, 2.0), rng.uniform(-1e9, 1e9)])
        rows.append((rng.randrange(3), rng.randrange(4096), rng.choice(reasons), x,
                     rng.choices(values, weights)[0], rng.randrange(4)))
    # Ties in count, among them two values whose order differs between UTF-16 (Java strings)
    # and code points (UTF-8 bytes, Python): a character above U+FFFF and one just below it.
    for value in TIED:
        rows += [(0, 7, None, 1.0, value, 1)] * 25
    return rows


TIED = ["\U0001f600", "\ufffd", "tie2", "tie1"]


TYPES = {"s": "int32", "b": "int32", "r": "string", "x": "float64", "a": "string", "y": "int64"}  # SCHEMA's


def _table(rows: list[tuple]):
    import pyarrow as pa

    return pa.table({name: pa.array([r[i] for r in rows], type=t) for i, (name, t) in enumerate(TYPES.items())})


@pytest.fixture(scope="module")
def frames(spark, tmp_path_factory):
    """``frames(n)``: the rows of ``_rows(n)`` as a Spark DataFrame of SCHEMA, read from a Parquet file
    written once per module (a frame made from Python rows runs Python workers in every job over it)."""
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("summary")
    written = {}

    def frame(n: int = 3000):
        if n not in written:
            written[n] = str(root / f"rows-{n}.parquet")
            pq.write_table(_table(_rows(n)), written[n])
        df = spark.read.parquet(written[n])
        assert df.schema == spark.createDataFrame([], SCHEMA).schema
        return df

    return frame


def _summary(frame, max_distinct: int = 100_000):
    return summarize(frame, split="s", bucket="b", reason="r", moments=["x"], categorical={"a": "a"}, label="y",
                     num_classes=4, selected="s = 0", num_splits=3, bucket_bits=12, max_distinct=max_distinct)


def _scanned_in_two_pieces(spec: ScanSpec, table):
    """``table`` scanned as the staging writer scans it, here in two tables, and the parts merged."""
    parts = []
    for piece in (table.slice(0, 1000), table.slice(1000)):
        scanner = spec.scanner()
        scanner.add(piece)
        parts.append(scanner.result())
    return spec.merge(parts, names=["x"])


def test_the_scan_inside_the_staging_writer_equals_the_scan_by_spark(frames):
    # The shard job takes the summary inside its staging pass, from whole Arrow tables of checked
    # rows (ScanSpec with a split index); it must equal the scan of the same rows by Spark, keyed
    # by feature names (fit looks vocabularies up by them), whatever tables the rows came in.
    want = _summary(frames())
    table = _table(_rows())
    spec = ScanSpec(split="s", bucket="b", reason="r", moments=("x",), categorical=(("feature", "a"),), label="y",
                    num_classes=4, selected=0, num_splits=3, bucket_bits=12)
    got = _scanned_in_two_pieces(spec, table)
    assert got.value_counts == {"feature": want.value_counts["a"]}
    assert (got.bucket_rows, got.by_reason, got.moments, got.class_counts) == (
        want.bucket_rows, want.by_reason, want.moments, want.class_counts)


def test_nulls_per_feature_are_counted_over_the_train_splits_clean_rows():
    # The manifest's null shares (preprocess.fit) are these counts over train_rows: nulls in bad
    # rows and in other splits must not count, whatever tables the rows came in; a list column
    # (an array feature) is counted too.
    import pyarrow as pa

    rows = _rows()
    lists = [None if i % 7 == 0 else [float(i)] * 3 for i in range(len(rows))]
    table = _table(rows).append_column("img", pa.array(lists, pa.list_(pa.float64())))
    spec = ScanSpec(split="s", bucket="b", reason="r", moments=("x",), categorical=(("a", "a"),), label="y",
                    num_classes=4, selected=0, num_splits=3, bucket_bits=12,
                    nulls=(("x", "x"), ("a", "a"), ("image", "img")))
    got = _scanned_in_two_pieces(spec, table)
    train = [i for i, r in enumerate(rows) if r[2] is None and r[0] == 0]
    assert got.train_rows == len(train) < len(rows)
    want = {"x": sum(rows[i][3] is None for i in train), "a": sum(rows[i][4] is None for i in train),
            "image": sum(lists[i] is None for i in train)}
    assert got.null_counts == want and all(want.values())
    assert sum(r[3] is None for r in rows) > want["x"]  # the other splits and bad rows hold nulls too


def test_counts_and_values_equal_spark_aggregations_on_any_partitioning(frames):
    frame = frames()
    results = [_summary(df) for df in (frame.coalesce(1), frame.repartition(5, "a"), frame.repartition(3))]
    assert results[0] == results[1] == results[2]
    got = results[0]

    clean = frame.where("r IS NULL")
    want_buckets = {(r["s"], r["b"]): r["count"] for r in clean.groupBy("s", "b").count().collect()}
    assert got.bucket_rows == want_buckets
    want_reasons = {r["r"]: r["count"] for r in frame.where("r IS NOT NULL").groupBy("r").count().collect()}
    assert got.by_reason == want_reasons and len(want_reasons) == 3
    train = clean.where("s = 0")
    classes = {r["y"]: r["count"] for r in train.groupBy("y").count().collect()}
    assert got.class_counts == [classes.get(c, 0) for c in range(4)]
    values = {r["a"]: r["count"] for r in train.where("a IS NOT NULL").groupBy("a").count().collect()}
    assert got.value_counts == {"a": values}
    assert got.moments[0][0] == train.where("x IS NOT NULL").count()


def test_partitions_of_only_bad_or_only_clean_rows_are_counted(frames):
    """Malformed records reach the scan as partitions of their own (the job unions them onto
    the checked rows): a partition with no clean row, and one with no bad row, count in full."""
    from pyspark.sql import functions as F

    rows = _rows(500)
    bad = [r for r in rows if r[2] is not None]
    clean = [r for r in rows if r[2] is None]
    assert bad and clean
    frame = (frames(500).withColumn("bad", F.expr("CAST(r IS NOT NULL AS INT)"))
             .repartitionByRange(2, "bad").drop("bad"))
    layout = frame.selectExpr("spark_partition_id() AS p", "r IS NULL AS clean").distinct().collect()
    assert sorted(r["clean"] for r in layout) == [False, True] and len({r["p"] for r in layout}) == 2
    got = _summary(frame)
    assert sum(got.by_reason.values()) == len(bad)
    assert sum(got.bucket_rows.values()) == len(clean)
    assert got == _summary(frames(500).repartition(3))


def test_vocabulary_from_counts_equals_sparks_ranking(frames):
    """top_values (the driver's ranking of the scan's counts) and spark_vocabularies (the
    fallback for wide features) give the same vocabulary: order by count, ties by value."""
    frame = frames()
    counted = _summary(frame)
    wide = _summary(frame, max_distinct=5)  # more than 5 values in a partition: left to Spark
    assert counted.value_counts["a"] is not None and wide.value_counts["a"] is None
    kind = Categorical([{"name": "a", "vocab": []}], 1024)
    train = frame.where("r IS NULL AND s = 0").withColumnRenamed("a", kind.typed("a"))
    for min_count, max_vocab in ((1, 100), (2, 100), (1, 5), (10, 3)):
        from_counts = top_values(counted.value_counts["a"], min_count, max_vocab)
        from_spark = kind.spark_vocabularies(train, ["a"], min_count, max_vocab)["a"]
        assert from_counts == from_spark
        assert len(from_counts) == min(max_vocab, sum(n >= min_count for n in counted.value_counts["a"].values()))
    vocab = top_values(counted.value_counts["a"], 1, 100)
    tied = [v for v in vocab if v in TIED]
    assert tied == sorted(TIED) == ["tie1", "tie2", "\ufffd", "\U0001f600"]
    assert len({counted.value_counts["a"][v] for v in TIED}) == 1  # really tied
