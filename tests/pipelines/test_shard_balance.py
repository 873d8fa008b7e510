"""Split and shard placement as the job computes them: the split SQL from pipelines/balance.py
evaluated on real Spark over many keys, the driver-side placement of buckets into shard files over
about 1,000 (rows, shards) pairs; config validation (no Spark)."""

import numpy as np
import pytest

from common.config import from_dict
from common.errors import ConfigError, InputDataError
from pipelines.balance import (BUCKET_BITS, check_split_rows, rows_per_row_group, shard_sizes, shard_starts,
                               split_bounds, split_draw_sql, split_index_sql)
from pipelines.preprocess import row_columns
from pipelines.shard_config import ShardConfig, load_shard_config
from shard_testdata import config, simple_rows, write_parquet

# Marked stack, test by test: what runs on Spark, and numpy's sorts; not the driver's placement
# arithmetic and config checks, plain Python on both profiles.


@pytest.mark.parametrize("rows,shards", [(1, 1), (7, 7), (10, 3), (100, 8), (1001, 4), (99_999, 16)])
def test_shard_sizes_differ_by_at_most_one_and_cover_every_row(rows, shards):
    sizes = shard_sizes(rows, shards)  # the job checks every written split against these
    assert len(sizes) == shards and sum(sizes) == rows
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the extra rows go to the first shards
    assert shard_starts(rows, shards) == [sum(sizes[:s]) for s in range(shards)]


# Every num_shards from 1 to 12 with every split size from num_shards to num_shards + 80, and a few
# large splits: about 1,000 (rows, shards) pairs.
PAIRS = [(rows, n) for n in range(1, 13) for rows in range(n, n + 81)] + [(1001, 4), (99_999, 16), (100_003, 7)]


def test_each_shard_file_keeps_its_block_of_ranks_from_whole_buckets():
    """The job's placement (shard_placement.shard_layout, then the writer keeping ranks [start, start +
    rows) of the buckets it reads): bucket b's rows take the next ranks after the buckets before
    it, so, with random bucket sizes (empty buckets absent, as in the summary's counts), file k of
    a split reads a run of whole buckets that holds shard k's block, every bucket it reads meets
    that block, and the blocks kept give each rank 0..rows-1 exactly once, in shard order."""
    import random

    from pipelines.shard_placement import RowCounts, shard_layout

    draw = random.Random(7)
    for rows, n in PAIRS:
        for s_splits in (1, 2):
            bucket_rows = {}
            for s in range(s_splits):
                used = sorted(draw.sample(range(1 << BUCKET_BITS), min(rows, draw.choice([1, 3, 50, 4096]))))
                cuts = sorted(draw.sample(range(1, rows), len(used) - 1)) if len(used) > 1 else []
                for b, size in zip(used, [hi - lo for lo, hi in zip([0, *cuts], [*cuts, rows])]):
                    bucket_rows[(s, b)] = size
            counts = RowCounts({s: rows for s in range(s_splits)}, bucket_rows, {}, rows * s_splits, 0)
            layout, file_starts = shard_layout(counts, s_splits, n)
            for s in range(s_splits):
                offsets, offset = {}, 0  # each bucket's first rank
                for b in sorted(b for (si, b) in bucket_rows if si == s):
                    offsets[b], offset = offset, offset + bucket_rows[(s, b)]
                kept = []
                for k, (start, size) in enumerate(zip(shard_starts(rows, n), shard_sizes(rows, n))):
                    read = [b for (si, b, f) in layout if si == s and f == s * n + k]
                    assert read == sorted(offsets)[sorted(offsets).index(read[0]):][:len(read)], (rows, n, k)
                    assert file_starts[s * n + k] == offsets[read[0]]
                    ranks = np.concatenate([np.arange(offsets[b], offsets[b] + bucket_rows[(s, b)]) for b in read])
                    block = ranks[(ranks >= start) & (ranks < start + size)]
                    assert len(block) == size, (rows, n, k)
                    for b in read:  # no bucket read for nothing
                        assert offsets[b] < start + size and offsets[b] + bucket_rows[(s, b)] > start, (rows, n, k, b)
                    kept.append(block)
                np.testing.assert_array_equal(np.concatenate(kept), np.arange(rows))


SPLITS = [{"train": 0.8, "val": 0.1, "test": 0.1}, {"train": 0.5, "test": 0.5}, {"train": 1.0},
          {"holdout": 0.05, "train": 0.7, "val": 0.25}]
KEYS = 200_000


@pytest.mark.stack  # Spark's partitioning
@pytest.mark.spark
def test_driver_partition_keys_land_in_their_own_spark_partition(spark):
    """The placement's partition keys are computed with a copy of Spark's Murmur3 on the driver:
    each must hash, in Spark, to its own partition, and the copy must equal Spark's hash."""
    from pipelines.shard_placement import partition_keys, spark_hash_long

    values = [0, 1, -1, 42, 2 ** 31 - 1, -2 ** 31, 2 ** 32, 2 ** 63 - 1, -2 ** 63, 123_456_789_012_345]
    got = {r["v"]: r["h"] for r in spark.createDataFrame([(v,) for v in values], "v BIGINT")
           .selectExpr("v", "hash(v) AS h").collect()}
    assert {v: spark_hash_long(v) for v in values} == got
    for n in (1, 2, 3, 12, 37, 300):
        keys = partition_keys(n)
        rows = spark.createDataFrame([(p, k) for p, k in enumerate(keys)], "p INT, k BIGINT")
        landed = rows.repartition(n, "k").selectExpr("p", "spark_partition_id() AS q").collect()
        assert sorted((r["p"], r["q"]) for r in landed) == [(p, p) for p in range(n)]


@pytest.mark.stack  # the split SQL on each Spark
@pytest.mark.spark
@pytest.mark.parametrize("fractions", SPLITS, ids=["80-10-10", "50-50", "all-train", "holdout-first"])
def test_split_sql_sends_a_key_to_the_first_split_whose_bound_exceeds_its_draw(spark, fractions):
    """Per split, the draws u of the keys it received lie inside its own [lower, upper) bound,
    in declared order, and its share of 200,000 keys is its fraction."""
    from pyspark.sql import functions as F

    key = "CAST(id AS STRING)"
    draws = spark.range(KEYS).selectExpr(f"{split_draw_sql(key, 5)} AS u", f"{split_index_sql(key, 5, fractions)} AS s")
    got = {r["s"]: r for r in draws.groupBy("s").agg(F.count("*").alias("count"), F.min("u").alias("lo"),
                                                     F.max("u").alias("hi")).collect()}
    lower = 0.0
    assert set(got) <= set(range(len(fractions)))
    for i, (name, upper) in enumerate(split_bounds(fractions)):
        row = got[i]
        assert lower <= row["lo"] and row["hi"] < upper, (name, row)
        assert abs(row["count"] / KEYS - fractions[name]) < 0.005, (name, row["count"])
        lower = upper


@pytest.mark.stack  # the split SQL on each Spark
@pytest.mark.spark
def test_the_job_splits_by_key_alone_and_the_seed_reshuffles(spark, tmp_path):
    """row_columns (the job's per-row SQL) puts rows sharing a key in one split whatever their
    other values, uses the split expression above, and split.seed changes the assignment."""
    rows = simple_rows(3000)
    rows["id"] = [i // 3 for i in rows["id"]]  # 1000 keys, 3 rows each with different values
    src = write_parquet(tmp_path / "in", rows)
    fractions = {"train": 0.6, "val": 0.2, "test": 0.2}
    table = spark.read.parquet(src)

    def splits(seed):
        cfg = config(src, str(tmp_path / "out"), split={"key": "id", "fractions": fractions, "seed": seed})
        return table.selectExpr(*row_columns(table, cfg)).selectExpr(
            "id", "_split", f"{split_index_sql('CAST(`id` AS STRING)', seed, fractions)} AS expected")

    first = splits(0)
    assert first.where("_split <> expected").count() == 0
    assert first.selectExpr("id", "_split").distinct().count() == 1000  # one split per key
    moved = first.join(splits(1).selectExpr("id", "_split AS other"), "id").where("_split <> other").count()
    assert moved > 0


def test_fewer_rows_than_shards_names_the_split_and_what_to_change():
    with pytest.raises(InputDataError, match=r"split 'val' has 3 rows.*num_shards=4.*at most 3"):
        check_split_rows("val", 3, 4)
    check_split_rows("val", 4, 4)


def test_row_group_mb_conversion():
    assert rows_per_row_group(123, None, 40) == 123
    assert rows_per_row_group(None, 1.0, 32) == (1 << 20) // 32
    assert rows_per_row_group(None, None, 1 << 30) == 1


def _cfg(**over):
    base = {"sources": {"raw": {"path": "/data", "format": "csv"}}, "features": {"numeric": ["x"]},
            "label": {"column": "y", "num_classes": 2}, "split": {"key": "id"}, "output": {"path": "/out"}}
    base.update(over)
    return from_dict(ShardConfig, base)


@pytest.mark.parametrize("over,message", [
    ({"split": {"key": "id", "fractions": {"train": 0.5, "val": 0.4}}}, "must add up to 1"),
    ({"split": {"key": "id", "fractions": {"val": 1.0}}}, "must include a train split"),
    ({"label": {"column": "y"}}, "num_classes"),
    ({"label": {"column": "y", "expr": "y + 1", "num_classes": 2}}, "exactly one"),
    ({"output": {"path": "/out", "num_shards": 0}}, "num_shards"),
    ({"output": {"path": "/out", "row_group_mb": 1, "rows_per_row_group": 5}}, "alternatives"),
    ({"features": {"numeric": ["x"], "arrays": {"img": [0, 3]}}}, "positive integers"),
    ({"quality": {"max_bad_fraction": 2}}, "max_bad_fraction"),
    ({"output": {"path": "/out", "nums_shards": 3}}, "did you mean 'output.num_shards'"),
    ({"sources": {"raw": {"path": "/a"}, "other": {"path": "/b"}}}, "query"),
])
def test_shard_config_rejects_bad_values_naming_the_key(over, message):
    with pytest.raises(ConfigError, match=message):
        _cfg(**over)


def test_example_config_loads_with_overrides():
    cfg = load_shard_config("conf/shard.yaml", ["output.num_shards=8", "split.seed=3"])
    assert cfg.output.num_shards == 8 and cfg.split.seed == 3
    assert cfg.features.arrays == {"image": [8]}


@pytest.mark.stack  # numpy's sorts
def test_rank_order_is_the_two_key_order_with_and_without_ties():
    # The shard writer sorts by the shuffle key alone and falls back to both keys on ties; either
    # way the order must be (shuffle unsigned, tiebreak signed), as a lexsort gives it.
    from pipelines.shard_writer import rank_order

    rng = np.random.default_rng(3)
    for ties in (False, True):
        shuffle = rng.integers(-2**63, 2**63 - 1, size=5000, dtype=np.int64)
        tiebreak = rng.integers(-2**63, 2**63 - 1, size=5000, dtype=np.int64)
        if ties:
            shuffle[:2500] = shuffle[2500:]  # equal shuffle keys, different tie-breaks
            shuffle[:3] = [-1, 0, 2**63 - 1]
        order = rank_order(shuffle, tiebreak)
        want = np.lexsort((tiebreak, shuffle.view(np.uint64)))
        assert ties == bool((np.diff(np.sort(shuffle.view(np.uint64))) == 0).any())
        assert (shuffle[order] == shuffle[want]).all() and (tiebreak[order] == tiebreak[want]).all()
