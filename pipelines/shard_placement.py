"""Where the shard job's rows and work go: how many Spark tasks and staging partitions the job
runs (``JobShape``), which staging partition holds which checked rows (``StagedRows``), and which
buckets each output file reads and which block of ranks it keeps (``shard_plans``), computed on the
driver from pass one's counts (``RowCounts``) and the balanced blocks of pipelines/balance.py.
pipelines/shard_job.py runs the passes; this module decides, on the driver, and writes nothing.

Ranking and placement without a global sort or a driver collect: the shuffle key's top 12 bits
form 4096 buckets per split; the counts per (split, bucket) come from pass one, so each bucket's
range of ranks is known, and shards are contiguous blocks of ranks, so each bucket belongs to a
known file (the few that straddle a shard boundary are read by both files). A file's task thus
reads whole buckets, a contiguous range of ranks; sorted by the shuffle key, a row's rank is the
range's start plus its position, and the file keeps its own block. The staging partitions are
ranges of buckets of each split (``output.staging_partitions`` of them: by default num_shards, or
a multiple where the cluster has more cores), so a file's buckets lie in one or a few staged
files (with fewer partitions than shards, each file reads a larger part of its split).

Placement without hash collisions: ``repartition(n, k)`` sends key k to ``pmod(murmur3(k), n)``,
so for each staging key we find a k that lands exactly in its own partition (Spark's Murmur3,
computed on the driver), rather than hoping hash buckets spread evenly (they do not).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from common.sources import source_bytes
from common.spark import default_parallelism
from common.storage import resolve
from pipelines.balance import BUCKET_BITS, shard_sizes, shard_starts
from pipelines.shard_config import ShardConfig
from pipelines.shard_writer import ShardPlan

# Sources of fewer bytes than this are a small job: there a Spark task's fixed cost (a Python
# worker round trip, a file) and a Spark job's (scheduling, planning) outweigh what parallel
# tasks save, so the job runs the fewest of both (``JobShape``; benchmarks/shard_small.py). It
# decides how the job runs, never what it writes (tests/pipelines/test_shard_job.py).
SMALL_INPUT_BYTES = 8 << 20


@dataclass(frozen=True)
class JobShape:
    """How many Spark tasks the job runs, decided before pass one; never what it writes.

    ``small``: the sources hold fewer than SMALL_INPUT_BYTES. Then each split is staged in one
    partition (unless ``output.staging_partitions`` says otherwise), its row count is checked
    from pass one's counts rather than by a Spark job of its own, and pass two writes the shard
    files and the quarantine in at most ``cores`` tasks, in one job. ``cores``: the cluster's
    default parallelism (under Spark Connect too: common.spark.default_parallelism)."""

    small: bool
    cores: int

    @classmethod
    def of(cls, spark, cfg: ShardConfig, sources_fp: dict) -> "JobShape":
        sizes = [source_bytes(source) for source in sources_fp.values()]
        size = SMALL_INPUT_BYTES if None in sizes else sum(sizes)  # unknown (a Delta table's): not small
        return cls(small=size < SMALL_INPUT_BYTES and cfg.teacher is None, cores=default_parallelism(spark))


# Input bytes per task of a kind's Python check stage (an image's decode), at least one task per core.
DECODE_PARTITION_BYTES = 64 << 20


def check_partitions(sources_fp: dict, cores: int) -> int | None:
    """Tasks for the rows' Python check stage (``preprocess.prepared_table``), or None to keep the
    read's own partitions (a source of unknown size). Spark packs small files into read partitions
    by ``spark.sql.files.openCostInBytes`` (4 MiB a file): a folder of 2,000 JPEGs of 23 KB became
    63 partitions, and an identity ``mapInArrow`` over them took 18-22 s where the same rows in 2
    tasks took 1.3-1.4 s (benchmarks/RESULTS.md, "Images: the shard job on a folder of JPEGs")."""
    sizes = [source_bytes(source) for source in sources_fp.values()]
    if None in sizes:
        return None
    return max(cores, math.ceil(sum(sizes) / DECODE_PARTITION_BYTES))


def staging_parts(cfg: ShardConfig, shape: JobShape) -> int:
    """Staging partitions per split: ``output.staging_partitions``, else num_shards times the
    smallest factor that gives every core of the cluster a task (pass one's writes and scans run
    in num_splits x parts tasks), or for a small job one. With a teacher, always num_shards: its
    soft targets are computed in these partitions, and their last bits depend on the batches
    (pipelines/teacher.py). The shard files do not depend on it (tests/pipelines/test_shard_job.py)."""
    n = cfg.output.num_shards
    if cfg.teacher is not None:
        return n
    if cfg.output.staging_partitions is not None:
        return cfg.output.staging_partitions
    if shape.small:
        return 1
    return n * max(1, math.ceil(shape.cores / (len(cfg.split.fractions) * n)))


def stage_key_sql(num_splits: int, parts: int) -> str:
    """A checked row's staging key (``StagedRows``)."""
    return (f"CAST(CASE WHEN _reason IS NOT NULL THEN {num_splits * parts} + pmod(xxhash64(_reason, _raw), {parts}) "
            f"ELSE _split * {parts} + ((_bucket * {parts}) DIV {1 << BUCKET_BITS}) END AS INT)")


@dataclass
class StagedRows:
    """The checked rows as the staging pass wrote them: one Parquet file per staging key under
    ``uri`` (the publish staging directory). Key ``s * parts + r`` holds split s's clean rows of
    bucket range r (the buckets b with ``b * parts >> BUCKET_BITS == r``), keys ``num_splits *
    parts + r`` the bad rows, spread by a hash of reason and raw text (a job whose rows are all
    bad still stages them in parallel before its quality gate fails); a key no row took has no
    file."""

    uri: str
    files: dict[int, str]
    parts: int
    num_splits: int

    def bad_paths(self) -> list[str]:
        first = self.num_splits * self.parts
        return [self.files[k] for k in range(first, first + self.parts) if k in self.files]

    def split_paths(self, split: int, buckets: tuple[int, int] = (0, (1 << BUCKET_BITS) - 1)) -> list[str]:
        """The files holding split ``split``'s clean rows of buckets ``buckets`` (first, last)."""
        first, last = ((b * self.parts) >> BUCKET_BITS for b in buckets)
        keys = (split * self.parts + r for r in range(first, last + 1))
        return [self.files[k] for k in keys if k in self.files]

    def frame(self, spark, paths: list[str]):
        """Those files as a Spark DataFrame (the vocabulary fallback, the quarantine)."""
        from common.spark import to_spark_path

        return spark.read.parquet(*[to_spark_path(resolve(self.uri).join(p).uri) for p in paths])


@dataclass
class RowCounts:
    """Pass one's counts (from its summary): they place the rows and feed the job's checks."""

    split_rows: dict[int, int]               # clean rows per split index
    bucket_rows: dict[tuple[int, int], int]  # clean rows per (split index, bucket)
    by_reason: dict[str, int]
    table_rows: int
    malformed: int

    @property
    def quarantined(self) -> int:
        return sum(self.by_reason.values())

    @property
    def input_rows(self) -> int:
        return self.table_rows + self.malformed


def shard_layout(counts: RowCounts, num_splits: int, n: int) -> tuple[list[tuple[int, int, int]], list[int]]:
    """(split, bucket, file) for each output file a bucket's ranks fall into, and per file the
    first rank of its first bucket.

    A bucket's rows take a contiguous range of its split's ranks (buckets in order), and shards
    take contiguous blocks of ranks, so a bucket meets one shard, or two or more where it straddles
    a boundary: those few buckets are read by each file they meet. A file thus reads whole
    buckets, a contiguous range of ranks from its start on, and keeps its own block of them.
    """
    layout = []
    file_starts = [0] * (num_splits * n)
    for s in range(num_splits):
        starts = shard_starts(counts.split_rows.get(s, 0), n)
        offset = 0
        first_rank: dict[int, int] = {}
        for b in sorted(b for (si, b) in counts.bucket_rows if si == s):
            size = counts.bucket_rows[(s, b)]
            first = bisect.bisect_right(starts, offset) - 1
            last = bisect.bisect_right(starts, offset + size - 1) - 1
            for k in range(first, last + 1):
                first_rank.setdefault(k, offset)
                layout.append((s, b, s * n + k))
            offset += size
        for k, rank in first_rank.items():
            file_starts[s * n + k] = rank
    return layout, file_starts


def shard_plans(staged: StagedRows, counts: RowCounts, num_splits: int, n: int) -> list[ShardPlan]:
    """Per output file: its buckets, the first rank among them, its block of ranks, the staged
    files that hold those buckets, and how many rows they must yield (``shard_layout``)."""
    layout, file_starts = shard_layout(counts, num_splits, n)
    buckets: dict[int, list[int]] = {}
    for s, b, f in layout:
        buckets.setdefault(f, []).append(b)
    starts = [shard_starts(counts.split_rows.get(s, 0), n) for s in range(num_splits)]
    sizes = [shard_sizes(counts.split_rows.get(s, 0), n) for s in range(num_splits)]
    plans = []
    for f in range(num_splits * n):
        s, k = divmod(f, n)
        lo, hi = min(buckets[f]), max(buckets[f])
        plans.append(ShardPlan(
            target=f, buckets=(lo, hi), first_rank=file_starts[f], start=starts[s][k], rows=sizes[s][k],
            inputs=tuple(staged.split_paths(s, (lo, hi))),
            bucket_rows=sum(counts.bucket_rows.get((s, b), 0) for b in range(lo, hi + 1))))
    return plans


def deal_to_tasks(sizes: list[int], tasks: int) -> list[tuple[int, ...]]:
    """The items (indexes into ``sizes``) each of ``tasks`` tasks writes: largest first, each to
    the task with the fewest rows so far, so tasks finish together. One task per item when
    there are as many tasks as items (a large job: one file per task, in file order)."""
    if tasks >= len(sizes):
        return [(i,) for i in range(len(sizes))]
    load = [0] * tasks
    dealt: list[list[int]] = [[] for _ in range(tasks)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        t = min(range(tasks), key=lambda t: (load[t], t))
        dealt[t].append(i)
        load[t] += sizes[i]
    return [tuple(items) for items in dealt]


def partition_keys(num_partitions: int) -> list[int]:
    """For each partition p, the smallest bigint k >= 0 with pmod(hash(k), n) == p, so that
    repartition(n, k) puts k in p. Spark's ``hash`` is Murmur3 (x86, 32-bit, seed 42); computing
    it here spares a Spark job per placement (tests/pipelines/test_shard_balance.py checks the
    keys against Spark's own ``hash``, and the writer fails on a partition holding two files)."""
    keys: dict[int, int] = {}
    k = 0
    while len(keys) < num_partitions:
        keys.setdefault(spark_hash_long(k) % num_partitions, k)  # Python's % is pmod for n > 0
        k += 1
    return [keys[p] for p in range(num_partitions)]


def partition_key_sql(num_partitions: int, index_sql: str) -> str:
    """The SQL of the key that ``repartition(num_partitions, key)`` sends to partition
    ``index_sql`` (an INT column or expression in [0, num_partitions), ``partition_keys``)."""
    return f"element_at({_literal_array(partition_keys(num_partitions))}, {index_sql} + 1)"



def _literal_array(values: list[int]) -> str:
    """A SQL array<bigint> literal."""
    return "array(" + ", ".join(f"{v}L" for v in values) + ")"


def spark_hash_long(value: int, seed: int = 42) -> int:
    """Spark SQL's ``hash(CAST(value AS BIGINT))`` (Murmur3_x86_32.hashLong), as a signed int."""
    value &= 0xFFFFFFFFFFFFFFFF
    h1 = _mix(_mix(seed, value & 0xFFFFFFFF), value >> 32)
    h1 ^= 8
    h1 ^= h1 >> 16
    h1 = (h1 * 0x85EBCA6B) & 0xFFFFFFFF
    h1 ^= h1 >> 13
    h1 = (h1 * 0xC2B2AE35) & 0xFFFFFFFF
    h1 ^= h1 >> 16
    return h1 - (1 << 32) if h1 & 0x80000000 else h1


def _rotl32(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF


def _mix(h1: int, word: int) -> int:
    k1 = _rotl32((word * 0xCC9E2D51) & 0xFFFFFFFF, 15) * 0x1B873593 & 0xFFFFFFFF
    return (_rotl32(h1 ^ k1, 13) * 5 + 0xE6546B64) & 0xFFFFFFFF


__all__ = ["SMALL_INPUT_BYTES", "JobShape", "RowCounts", "StagedRows", "deal_to_tasks", "partition_key_sql",
           "partition_keys", "shard_layout", "shard_plans", "spark_hash_long", "stage_key_sql", "staging_parts"]
