"""The arithmetic of splits and balanced shards: the Spark SQL the job evaluates per row, and the
driver-side numbers it checks the written files against. Tests run these same expressions on
real Spark (tests/pipelines/test_shard_balance.py).

Split: a row's key hashes to u in [0, 1) (53 bits of xxhash64(seed, key)); the row goes to the
first split, in declared order, whose cumulative fraction exceeds u (``split_index_sql``).

Shards: within a split, rows are ranked 0..N-1 by a seeded shuffle key; rank ``idx`` goes to
shard ``idx % num_shards`` at position ``idx // num_shards`` (``shard_sql``, ``row_index_sql``).
Shard sizes then differ by at most one (the first ``N % num_shards`` shards get the extra row),
whatever N is, as long as N >= num_shards.
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


def shard_sql(num_shards, idx: str = "_idx") -> str:
    """The shard (0-based, within the split) of the row ranked ``idx``: ranks are dealt round-robin."""
    return f"pmod({idx}, {num_shards})"


def row_index_sql(num_shards, idx: str = "_idx", base: str = "_base", extra: str = "_extra") -> str:
    """The row's ``_row``: rows in earlier shards of the split plus its position in its shard.
    ``base``/``extra``: the split's rows divmod num_shards (the first ``extra`` shards hold one more)."""
    shard = shard_sql(num_shards, idx)
    return f"{shard} * {base} + least({shard}, {extra}) + ({idx} DIV {num_shards})"


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
