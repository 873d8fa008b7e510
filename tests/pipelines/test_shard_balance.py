"""Pure logic: split bounds, shard sizes and positions, row groups, config validation (no Spark)."""

import pytest

from pipelines.balance import (check_split_rows, row_group_sizes, rows_per_row_group, shard_of, shard_offset,
                               shard_sizes, split_bounds, split_of)
from common.config import from_dict
from common.errors import ConfigError, InputDataError
from pipelines.shard_config import ShardConfig, load_shard_config


@pytest.mark.parametrize("rows,shards", [(1, 1), (7, 7), (10, 3), (100, 8), (1001, 4), (99_999, 16)])
def test_shard_sizes_differ_by_at_most_one_and_cover_every_row(rows, shards):
    sizes = shard_sizes(rows, shards)
    assert len(sizes) == shards and sum(sizes) == rows
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the extra rows go to the first shards


@pytest.mark.parametrize("rows,shards", [(10, 3), (17, 4), (8, 8), (23, 5)])
def test_rank_to_shard_position_and_row_index_is_a_bijection(rows, shards):
    sizes = shard_sizes(rows, shards)
    seen = set()
    for idx in range(rows):
        shard, pos = shard_of(idx, shards)
        assert pos < sizes[shard]
        row = shard_offset(shard, rows, shards) + pos  # _row: files concatenated in order
        seen.add(row)
    assert seen == set(range(rows))


def test_fewer_rows_than_shards_names_the_split_and_what_to_change():
    with pytest.raises(InputDataError, match=r"split 'val' has 3 rows.*num_shards=4.*at most 3"):
        check_split_rows("val", 3, 4)
    check_split_rows("val", 4, 4)


def test_split_bounds_follow_declared_order_and_end_at_one():
    fractions = {"train": 0.7, "val": 0.2, "test": 0.1}
    bounds = split_bounds(fractions)
    assert [b[0] for b in bounds] == ["train", "val", "test"]
    assert bounds[-1][1] == 1.0
    assert split_of(0.0, fractions) == "train"
    assert split_of(0.69999, fractions) == "train"
    assert split_of(0.7, fractions) == "val"
    assert split_of(0.95, fractions) == "test"
    assert split_of(0.999999999, fractions) == "test"


def test_split_fractions_are_respected_on_uniform_draws():
    fractions = {"train": 0.8, "val": 0.1, "test": 0.1}
    n = 10_000
    counts = {}
    for i in range(n):
        s = split_of((i + 0.5) / n, fractions)
        counts[s] = counts.get(s, 0) + 1
    assert counts == {"train": 8000, "val": 1000, "test": 1000}


def test_row_group_sizes_and_mb_conversion():
    assert row_group_sizes(250, 100) == [100, 100, 50]
    assert row_group_sizes(200, 100) == [100, 100]
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
