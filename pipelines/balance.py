"""The arithmetic of splits and balanced shards: the split's Spark SQL, which the job evaluates per
row, and the driver-side blocks of ranks each shard holds, which the shard writer keeps and the job
checks the written files against (tests/pipelines/test_shard_balance.py runs the SQL on real Spark).

Split: a row's key hashes to u in [0, 1) (53 bits of xxhash64(seed, key)); the row goes to the
first split, in declared order, whose cumulative fraction exceeds u (``split_index_sql``).

Shards: within a split, rows are ranked 0..N-1 by a seeded shuffle key, and the shards take
contiguous blocks of ranks in order: the first ``N % num_shards`` shards hold ``N // num_shards + 1``
rows, the others ``N // num_shards`` (``shard_sizes``, ``shard_starts``), so sizes differ by at most
one whatever N is, as long as N >= num_shards. A row's ``_row`` is its rank. Contiguous blocks let
the job place rows with one shuffle: a hash bucket of the shuffle key covers a range of ranks known
from the counts, so it belongs to one shard, or (at a shard boundary) to two.
"""

from __future__ import annotations

from common.errors import InputDataError

HASH_BITS = 53  # a double holds 53 bits exactly, so u is exact
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


def split_draw_sql(key_sql: str, seed: int) -> str:
    """u in [0, 1) for the key: 53 bits of xxhash64(seed, key), exact as a double."""
    return f"(CAST(xxhash64({int(seed)}, {key_sql}) & {(1 << HASH_BITS) - 1} AS DOUBLE) / {float(1 << HASH_BITS)!r})"


def split_index_sql(key_sql: str, seed: int, fractions: dict[str, float]) -> str:
    """The split's index in declared order: the first whose cumulative bound exceeds u."""
    u = split_draw_sql(key_sql, seed)
    cases = " ".join(f"WHEN {u} < {upper!r} THEN {i}" for i, (_, upper) in enumerate(split_bounds(fractions)[:-1]))
    last = len(fractions) - 1
    return f"CAST({'CASE ' + cases + f' ELSE {last} END' if cases else last} AS INT)"


def shard_sizes(rows: int, num_shards: int) -> list[int]:
    base, extra = divmod(rows, num_shards)
    return [base + (1 if s < extra else 0) for s in range(num_shards)]


def shard_starts(rows: int, num_shards: int) -> list[int]:
    """The first rank of each shard: shard s holds ranks [starts[s], starts[s] + sizes[s])."""
    starts, start = [], 0
    for size in shard_sizes(rows, num_shards):
        starts.append(start)
        start += size
    return starts


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


def check_input_rows(where: str, rows_seen: int, num_shards: int) -> None:
    """Before any pass over the rows: ``rows_seen`` (at most num_shards, counted by a limit) below
    num_shards means no split can have a row per shard, so ``check_split_rows`` would fail anyway
    after the whole first pass (which, with many shards, is many tasks)."""
    if rows_seen < num_shards:
        raise InputDataError(
            f"{where} has {rows_seen} rows, fewer than output.num_shards={num_shards}, so some shard would be "
            f"empty; lower output.num_shards to at most {max(rows_seen, 1)}, or add input rows")


def rows_per_row_group(rows_per_row_group: int | None, row_group_mb: float | None, row_bytes: int) -> int:
    """The configured row-group size in rows (row_group_mb is converted with the stored row width)."""
    if rows_per_row_group is not None:
        return rows_per_row_group
    mb = row_group_mb if row_group_mb is not None else DEFAULT_ROW_GROUP_MB
    return max(1, int(mb * (1 << 20)) // max(1, row_bytes))
