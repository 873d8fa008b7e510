"""The arithmetic of splits and balanced shards, as pure functions (unit-tested without Spark).

Split: a row's key hashes to u in [0, 1) (53 bits of xxhash64(seed, key)); the row goes to the
first split, in declared order, whose cumulative fraction exceeds u. The Spark expression in
shard_job.py and ``split_of`` here implement the same rule.

Shards: within a split, rows are ranked 0..N-1 by a seeded shuffle key; rank ``idx`` goes to
shard ``idx % num_shards`` at position ``idx // num_shards``. Shard sizes then differ by at most
one (the first ``N % num_shards`` shards get the extra row), whatever N is, as long as
N >= num_shards.
"""

from __future__ import annotations

from common.errors import InputDataError

HASH_BITS = 53  # a double holds 53 bits exactly, so u is exact in Spark and in Python
BUCKET_BITS = 12  # the shuffle key's top bits: 4096 buckets per split, ranked in parallel
DEFAULT_ROW_GROUP_MB = 16.0


def split_bounds(fractions: dict[str, float]) -> list[tuple[str, float]]:
    """(name, cumulative upper bound) in declared order; the last bound is exactly 1."""
    bounds, total = [], 0.0
    names = list(fractions)
    for i, name in enumerate(names):
        total += fractions[name]
        bounds.append((name, 1.0 if i == len(names) - 1 else total))
    return bounds


def split_of(u: float, fractions: dict[str, float]) -> str:
    for name, upper in split_bounds(fractions):
        if u < upper:
            return name
    return list(fractions)[-1]


def shard_sizes(rows: int, num_shards: int) -> list[int]:
    base, extra = divmod(rows, num_shards)
    return [base + (1 if s < extra else 0) for s in range(num_shards)]


def shard_of(idx: int, num_shards: int) -> tuple[int, int]:
    """Rank in the split -> (shard, position in the shard)."""
    return idx % num_shards, idx // num_shards


def shard_offset(shard: int, rows: int, num_shards: int) -> int:
    """Rows in shards before ``shard``: the ``_row`` of its first row."""
    base, extra = divmod(rows, num_shards)
    return shard * base + min(shard, extra)


def row_group_sizes(rows: int, rows_per_row_group: int) -> list[int]:
    full, rest = divmod(rows, rows_per_row_group)
    return [rows_per_row_group] * full + ([rest] if rest else [])


def check_split_rows(split: str, rows: int, num_shards: int) -> None:
    if rows == 0:
        raise InputDataError(
            f"split {split!r} has 0 rows: no clean input row's split.key falls into it; give "
            f"split.fractions.{split} a larger share, remove the split, or add input rows (with few distinct "
            "split.key values, a small split can end up empty)")
    if rows < num_shards:
        raise InputDataError(
            f"split {split!r} has {rows} rows, fewer than output.num_shards={num_shards}, so some shard would be "
            f"empty; lower output.num_shards to at most {max(rows, 1)}, give split.fractions.{split} a larger "
            "share, or add input rows")


def rows_per_row_group(rows_per_row_group: int | None, row_group_mb: float | None, row_bytes: int) -> int:
    """The configured row-group size in rows (row_group_mb is converted with the stored row width)."""
    if rows_per_row_group is not None:
        return rows_per_row_group
    mb = row_group_mb if row_group_mb is not None else DEFAULT_ROW_GROUP_MB
    return max(1, int(mb * (1 << 20)) // max(1, row_bytes))
