"""The shard job: sources -> Spark SQL -> quarantine -> deterministic split -> balanced shards + manifest.

``run_shard_job(spark, cfg)`` is the one entry point; ``shardtrain shard``, the spark-submit job
file and the notebook API all call it. The order is fixed so that nothing is published until
every check that can fail has passed (what is written before lands in a staging directory that
a failure removes):

0. the output may not be, contain or sit inside a source; the output's writer lock is taken
   (held to the end) and staging left by killed jobs is removed;
1. mode check (``error`` refuses, ``skip_if_exists`` compares the input fingerprint and returns,
   ``overwrite`` accepts only a dataset at the path);
2. read sources, build the table (query, transform), check columns and types;
3. inside ``storage.publish`` (a staging directory, removed on any failure): evaluate the row
   expressions once and write the checked rows (split, keys, typed values, reason; malformed
   records too) as Parquet under the staging directory; every later pass reads those files
   (only the columns it needs), and they are removed before the commit;
4. one scan of the staged rows (pipelines/summary.py): rows per split, bucket and quarantine
   reason, and over the train split the exact moments, value counts and class counts; quality
   gate, and every split must have at least num_shards rows;
5. the statistics and vocabularies from that scan; with ``teacher``, its soft targets join
   the rows as one more column (pipelines/teacher.py; the model's description was read and
   checked before step 1); encode (the ``prepared`` rows);
6. rank each split's rows by a seeded shuffle key, place each output file in its own Spark
   partition, write it with pyarrow on the executor (shard_writer.py), write the quarantine,
   check input = published + quarantined, write the manifest and config; commit.

Ranking and placement with one shuffle, without a global sort or a driver collect: the shuffle
key's top 12 bits form 4096 buckets per split; the counts per (split, bucket) come from step 4,
so each bucket's range of ranks is known, and shards are contiguous blocks of ranks, so each
bucket belongs to a known file (the few that straddle a shard boundary are sent to both files).
A file's partition thus holds whole buckets, a contiguous range of ranks; sorted by the shuffle
key, a row's rank is the range's start plus its position, and the file keeps its own block.

Placement without hash collisions: ``repartition(n, k)`` sends key k to ``pmod(murmur3(k), n)``,
so for each output file we find a key that lands exactly in its own partition (Spark's Murmur3,
computed on the driver), rather than hoping hash buckets spread evenly (they do not).
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass

from common import __version__
from pipelines.balance import (BUCKET_BITS, check_split_rows, row_index_sql, rows_per_row_group, shard_sizes, shard_sql,
                              shard_starts)
from common.config import dump_yaml, to_dict
from common.plugins import load_callable
from common.errors import AccountingError, InputDataError, OutputExistsError, QualityGateError, first_line
from common.dataset import (FORMAT_VERSION, ROW_INDEX, Manifest, arrow_schema, build_manifest, read_manifest,
                            row_bytes, write_manifest)
from pipelines.preprocess import cat_col, check_table, encode, fit, moment_values, q, row_columns, stored_schema
from pipelines.shard_config import ShardConfig
from pipelines.summary import Summary, summarize
from pipelines.shard_writer import RESULT_DDL, TARGET_COLUMN, write_empty, write_partition
from pipelines.sources import CORRUPT_COLUMN, MALFORMED, read_sources, source_fingerprint
from pipelines.teacher import TeacherScorer, teacher_record, with_teacher
from common.storage import (KIND_DATASET, check_disjoint, check_replaceable, clean_stale_staging, is_committed,
                            output_lock, publish, resolve, storage_errors)

log = logging.getLogger("shardtrain.shard")

QUARANTINE_DIR = "_quarantine"
QUARANTINE_ROWS_PER_FILE = 1_000_000
CONFIG_NAME = "config.yaml"


@dataclass
class ShardResult:
    uri: str
    manifest: Manifest
    skipped: bool = False


def run_shard_job(spark, cfg: ShardConfig, teacher_scorer: TeacherScorer | None = None) -> ShardResult:
    """Run the job under the output's writer lock (a second writer fails, naming this one).
    ``teacher_scorer``: what runs ``cfg.teacher`` (pipelines/teacher.py; the shardtrain layer passes it)."""
    out = resolve(cfg.output.path)
    check_output_path(cfg)
    with output_lock(out.uri):
        clean_stale_staging(out.uri)  # left by killed jobs; we hold the lock, so no live job owns it
        return _run_locked(spark, cfg, out, teacher_scorer)


def check_output_path(cfg: ShardConfig) -> None:
    """output.path must not be, contain or sit inside a source (exit 2, before any work)."""
    inputs = {f"source {name!r} (sources.{name}.path)": src.path for name, src in cfg.sources.items()}
    if cfg.teacher is not None:
        inputs["the teacher model (teacher.model)"] = cfg.teacher.model
    check_disjoint(cfg.output.path, "output.path", inputs)


def _run_locked(spark, cfg: ShardConfig, out, teacher_scorer: TeacherScorer | None) -> ShardResult:

    teacher = teacher_record(cfg, teacher_scorer)  # None without cfg.teacher
    sources_fp = {name: source_fingerprint(name, src) for name, src in cfg.sources.items()}
    input_fp = input_fingerprint(cfg, sources_fp, teacher)
    existing = _check_existing(out, cfg, input_fp)
    if existing is not None:
        log.info("%s already holds this dataset (input fingerprint %s); skipping", out.uri, input_fp[:12])
        return ShardResult(uri=out.uri, manifest=existing, skipped=True)

    frames = read_sources(spark, cfg)
    try:
        return _run_passes(spark, cfg, out, frames, sources_fp, input_fp, teacher, teacher_scorer)
    finally:
        for frame in frames.values():
            frame.release()


def _run_passes(spark, cfg: ShardConfig, out, frames, sources_fp: dict, input_fp: str, teacher: dict | None,
                teacher_scorer: TeacherScorer | None) -> ShardResult:
    from common.spark import spark_errors

    table, where = _build_table(spark, cfg, frames)
    check_table(table, cfg, where)
    with spark_errors("building the row checks and split columns"):
        checked = _checked_rows(table, cfg, frames)
    split_names = list(cfg.split.fractions)
    timer = _PhaseTimer()
    mode = "overwrite" if cfg.output.mode == "overwrite" else "error"
    # Everything from here on happens inside the staging directory: a failed check (quality gate,
    # split sizes, accounting) removes it with whatever was written, and the output is untouched.
    with publish(out.uri, mode=mode, marker={"kind": KIND_DATASET, "input_fingerprint": input_fp}) as staging:
        with spark_errors("reading and checking the input rows"):
            rows = _stage_rows(spark, checked, staging)
        staged_s = timer.lap()
        with spark_errors("counting rows per split and quarantine reason, and the train statistics"):
            counts, summary = _count(rows, cfg)
        timer.report("read, check and stage rows", counts.input_rows, staged_s)
        timer.done("count rows, train moments and values", counts.input_rows)
        _quality_gate(cfg, counts)
        for i, name in enumerate(split_names):
            check_split_rows(name, counts.split_rows.get(i, 0), cfg.output.num_shards)
        _check_numeric_coverage(cfg, counts)

        clean = rows.where("_reason IS NULL")
        with spark_errors("fitting statistics and vocabularies on the train split"):
            stats = fit(clean.where(f"_split = {split_names.index('train')}"), cfg, summary)
        timer.done("fit statistics and vocabularies on train", counts.split_rows.get(split_names.index("train"), 0))
        with spark_errors("building the fitted encodings"):
            prepared = encode(with_teacher(clean, cfg, teacher_scorer, teacher), cfg, stats)
        # `prepared` is the one point where the validated, encoded rows exist as a DataFrame
        # (placement columns _split, _bucket, _shuffle, _tiebreak + the stored columns): a step over
        # the rows plugs in here, before placement. It must keep every row and be deterministic.

        columns = stored_schema(cfg, teacher)
        rpg = rows_per_row_group(cfg.output.rows_per_row_group, cfg.output.row_group_mb, row_bytes(columns))
        with spark_errors("writing the balanced shards"):
            files = _write_shards(spark, prepared, cfg, counts, columns, rpg, staging.uri)
        timer.done("write balanced shards", sum(counts.split_rows.values()))
        with spark_errors("writing the quarantine"):
            qfiles = _write_quarantine(spark, rows, counts, staging.uri)
        timer.done("write quarantine", counts.quarantined)
        _remove_staged_rows(staging)
        splits = _split_entries(split_names, files, counts, cfg.output.num_shards)
        accounting = _check_accounting(counts, splits, qfiles)
        features = {"numeric": stats.numeric, "categorical": stats.categorical,
                    "arrays": [{"name": n, "shape": list(s)} for n, s in cfg.features.arrays.items()]}
        manifest = build_manifest(
            splits, features, stats.label, teacher=teacher, num_shards=cfg.output.num_shards, rows_per_row_group=rpg,
            quarantine={"path": QUARANTINE_DIR, "rows": counts.quarantined,
                        "by_reason": dict(sorted(counts.by_reason.items())), "files": qfiles},
            accounting=accounting, sources=sources_fp, config=to_dict(cfg), input_fingerprint=input_fp)
        if manifest["schema"] != columns:
            raise AccountingError(f"the written columns {columns} differ from the manifest schema "
                                  f"{manifest['schema']}; nothing was published")
        write_manifest(staging, manifest)
        staging.write_text(CONFIG_NAME, dump_yaml(cfg))
    log.info("published %s: %s", out.uri, ", ".join(f"{s}={v['rows']}" for s, v in splits.items()))
    return ShardResult(uri=out.uri, manifest=read_manifest(out.uri), skipped=False)


# Not hidden (_ or .): Spark warns about, then reads, a path it would skip when listing.
STAGED_ROWS_DIR = "checked-rows"


def _checked_rows(table, cfg: ShardConfig, frames):
    """Every input row as the later passes need it: split, bucket and shuffle keys, the typed
    values, the quarantine reason, and for bad rows only the row as text and its source's name.
    Malformed records (CSV/JSON) are among them, with reason ``malformed_record``."""
    parse = _single_parse(cfg, frames)
    if parse is not None:
        # The table is one text source's clean rows: check the parse itself, so the text is read
        # once, and a record that did not parse takes the first reason (its other values are null).
        checked = parse.selectExpr(*row_columns(parse, cfg))
        data_columns = [c for c in parse.columns if c != CORRUPT_COLUMN]
        reason = f"CASE WHEN {q(CORRUPT_COLUMN)} IS NOT NULL THEN '{MALFORMED}' ELSE _reason END"
        raw = (f"CASE WHEN {q(CORRUPT_COLUMN)} IS NOT NULL THEN {q(CORRUPT_COLUMN)} "
               f"WHEN _reason IS NOT NULL THEN to_json(struct({', '.join(q(c) for c in data_columns)})) END")
        return _kept_columns(checked, parse.columns, reason, raw, _sql_string(next(iter(frames))))
    checked = table.selectExpr(*row_columns(table, cfg))
    raw = f"CASE WHEN _reason IS NOT NULL THEN to_json(struct({', '.join(q(c) for c in table.columns)})) END"
    # Row-level reasons name the table's source, or "query" for a query's rows.
    source = "query" if cfg.query is not None else next(iter(frames))
    rows = _kept_columns(checked, table.columns, "_reason", raw, _sql_string(source))
    for frame in frames.values():
        if frame.malformed is not None:
            rows = rows.unionByName(frame.malformed.selectExpr("reason AS _reason", "raw AS _raw", "source AS _source"),
                                    allowMissingColumns=True)
    return rows


def _single_parse(cfg: ShardConfig, frames):
    """The unpersisted parse of the one CSV/JSON source when the table is its clean rows as they are."""
    if cfg.query is not None or cfg.transform is not None:
        return None
    (frame,) = frames.values()
    return frame.unpersisted


def _kept_columns(checked, table_columns: list[str], reason: str, raw: str, source: str):
    kept = [c for c in checked.columns if c not in set(table_columns) and c != "_reason"]
    return checked.selectExpr(
        *[q(c) for c in kept], f"CAST(shiftrightunsigned(_shuffle, {64 - BUCKET_BITS}) AS INT) AS _bucket",
        f"{reason} AS _reason", f"{raw} AS _raw", f"CASE WHEN {reason} IS NOT NULL THEN {source} END AS _source")


def _stage_rows(spark, checked, staging):
    """Write the checked rows once, as Parquet inside the staging directory, and return them read back.

    The source is read and the row expressions evaluated once, not once per pass; the later
    passes read only the columns they use. A Parquet write cost far less than building Spark's
    in-memory cache of the same rows (benchmarks/RESULTS.md, issue 11), and a task retried later
    re-reads the same files, so it sees the same rows. Removed before the commit.
    """
    from common.spark import to_spark_path

    path = to_spark_path(staging.join(STAGED_ROWS_DIR).uri)
    # No dictionary encoding: most staged columns are hashes and measurements, where building
    # dictionaries only to drop them cost time (2M rows: 4.3-4.4 s instead of 4.9-6.6 s).
    checked.write.mode("error").option("parquet.enable.dictionary", "false").parquet(path)
    return spark.read.parquet(path)


def _remove_staged_rows(staging) -> None:
    loc = staging.join(STAGED_ROWS_DIR)
    with storage_errors("removing the staged rows", loc.uri):
        loc.fs.rm(loc.path, recursive=True)


def input_fingerprint(cfg: ShardConfig, sources_fp: dict, teacher: dict | None = None) -> str:
    """What the output is a function of: the config (minus how it runs), the input files, and the
    teacher model's own fingerprint (a model replaced at the same URI gives other soft targets)."""
    config = to_dict(cfg)
    config.pop("spark", None)
    config["output"].pop("mode", None)
    payload = {"config": config, "sources": sources_fp, "shardtrain_version": __version__,
               "format_version": FORMAT_VERSION}
    if teacher is not None:
        payload["teacher_fingerprint"] = teacher["fingerprint"]
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _check_existing(out, cfg: ShardConfig, input_fp: str) -> Manifest | None:
    if not out.exists():
        return None
    mode = cfg.output.mode
    if mode == "error":
        raise OutputExistsError(f"{out.uri} already exists; set output.mode=overwrite to replace it "
                                "(or skip_if_exists to keep an identical one)")
    if mode == "skip_if_exists":
        if not is_committed(out):
            raise OutputExistsError(f"{out.uri} exists but is not a committed dataset (a job died while publishing "
                                    "it?); set output.mode=overwrite to replace it")
        manifest = read_manifest(out)
        if manifest.data.get("input_fingerprint") == input_fp:
            return manifest
        raise OutputExistsError(f"{out.uri} holds a different dataset (the config or the source files changed since "
                                "it was written); set output.mode=overwrite to replace it")
    check_replaceable(out.uri, KIND_DATASET)  # overwrite: only a dataset, never someone's files
    return None


def _build_table(spark, cfg: ShardConfig, frames):
    from common.spark import spark_errors

    if cfg.query is not None:
        where = "the table produced by `query`"
        try:
            table = spark.sql(cfg.query)
        except Exception as exc:  # noqa: BLE001 - AnalysisException / ParseException
            raise InputDataError(f"query failed to analyse over sources {sorted(frames)}: {first_line(exc)}") from None
    else:
        (name, frame), = frames.items()
        where = f"source {name!r} ({frame.config.path})"
        table = frame.clean
    if cfg.transform is not None:
        func = load_callable(cfg.transform, "transform")
        with spark_errors(f"transform {cfg.transform}"):
            table = func(table)
        where = f"the table returned by transform {cfg.transform!r}"
    return table, where


@dataclass
class RowCounts:
    split_rows: dict[int, int]               # clean rows per split index
    bucket_rows: dict[tuple[int, int], int]  # clean rows per (split index, bucket)
    by_reason: dict[str, int]
    table_rows: int
    malformed: int
    train_moments: list[tuple[int, float, float]]  # (count, mean, m2) per preprocess.moment_values

    @property
    def quarantined(self) -> int:
        return sum(self.by_reason.values())

    @property
    def input_rows(self) -> int:
        return self.table_rows + self.malformed


def _count(rows, cfg: ShardConfig) -> tuple[RowCounts, Summary]:
    """One scan of the staged rows (pipelines/summary.py): rows per (split, bucket) and per
    reason, and over the train split's clean rows the exact moments, value counts and class counts."""
    train = list(cfg.split.fractions).index("train")
    label = cfg.label
    summary = summarize(rows, split="_split", bucket="_bucket", reason="_reason", moments=moment_values(cfg),
                        categorical={name: cat_col(name) for name in cfg.features.categorical},
                        label="_label" if label.task == "classification" else None,
                        num_classes=label.num_classes or 0, selected=f"_split = {train}",
                        num_splits=len(cfg.split.fractions), bucket_bits=BUCKET_BITS)
    split_rows: dict[int, int] = {}
    for (s, _), n in summary.bucket_rows.items():
        split_rows[s] = split_rows.get(s, 0) + n
    by_reason = summary.by_reason
    malformed = by_reason.get(MALFORMED, 0)  # staged with the rows (_checked_rows)
    table_rows = sum(split_rows.values()) + sum(by_reason.values()) - malformed
    return RowCounts(split_rows, summary.bucket_rows, by_reason, table_rows, malformed, summary.moments), summary


def _quality_gate(cfg: ShardConfig, counts: RowCounts) -> None:
    total = counts.input_rows
    if total == 0:
        raise InputDataError(f"the input has no rows (sources: {', '.join(s.path for s in cfg.sources.values())})")
    fraction = counts.quarantined / total
    if fraction > cfg.quality.max_bad_fraction:
        reasons = ", ".join(f"{r}={n}" for r, n in sorted(counts.by_reason.items(), key=lambda kv: (-kv[1], kv[0])))
        raise QualityGateError(
            f"{counts.quarantined} of {total} input rows ({fraction:.2%}) are bad, above "
            f"quality.max_bad_fraction={cfg.quality.max_bad_fraction:g}: {reasons}. Nothing was written; fix the "
            "input, or raise quality.max_bad_fraction to publish the good rows and quarantine the rest")


def _check_numeric_coverage(cfg: ShardConfig, counts: RowCounts) -> None:
    """A numeric feature with no value in any train row has nothing to learn statistics from:
    storing it as all zeros would hide a broken input, unless the user says what to fill."""
    empty = [name for name, (count, _, _) in zip(cfg.features.numeric, counts.train_moments)
             if count == 0 and name not in cfg.features.impute]
    if empty:
        raise InputDataError(
            f"numeric feature column(s) {empty} (features.numeric) have no value in any train row (all null or "
            f"NaN); fix the input, remove the column from features.numeric, or give features.impute.{empty[0]} "
            "a value to store")


def _partition_keys(num_partitions: int) -> list[int]:
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


def _rotl32(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF


def _mix(h1: int, word: int) -> int:
    k1 = _rotl32((word * 0xCC9E2D51) & 0xFFFFFFFF, 15) * 0x1B873593 & 0xFFFFFFFF
    return (_rotl32(h1 ^ k1, 13) * 5 + 0xE6546B64) & 0xFFFFFFFF


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


def _shard_layout(counts: RowCounts, num_splits: int, n: int) -> tuple[list[tuple[int, int, int]], list[int]]:
    """(split, bucket, file) for each output file a bucket's ranks fall into, and per file the
    first rank of its first bucket.

    A bucket's rows take a contiguous range of its split's ranks (buckets in order), and shards
    take contiguous blocks of ranks, so a bucket meets one shard, or two or more where it straddles
    a boundary: those few buckets are sent to each file they meet. A file thus receives whole
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


def _literal_array(values: list[int]) -> str:
    """A SQL array<bigint> literal."""
    return "array(" + ", ".join(f"{v}L" for v in values) + ")"


# Sorting by the shuffle key as an unsigned number is sorting by (bucket = its top bits, key).
_RANK_ORDER = "_shuffle ^ shiftleft(1L, 63)"
# monotonically_increasing_id(): the partition index in the upper 31 bits, the row's position in
# the partition in the lower 33.
_POSITION_BITS = 33


def _write_shards(spark, prepared, cfg: ShardConfig, counts: RowCounts, columns: list[dict], rpg: int,
                  staging_uri: str) -> list[dict]:
    """Rank, place and write with one shuffle: each file's rows (whole buckets, so a few rows
    beyond its block at each end) go to the file's own partition, which is sorted in rank order;
    a row's rank is the file's first rank plus its position, and the file keeps its block."""
    from pyspark.sql import functions as F

    from common.spark import local_frame

    n = cfg.output.num_shards
    split_names = list(cfg.split.fractions)
    rows, file_starts = _shard_layout(counts, len(split_names), n)
    layout = local_frame(spark, rows, "_split INT, _bucket INT, _file INT")
    targets = [f"{split}/part-{s:05d}.parquet" for split in split_names for s in range(n)]
    keys = _partition_keys(len(targets))
    data_cols = [c["name"] for c in columns if c["name"] != ROW_INDEX]
    # Only what placement needs after the shuffle travels with the rows: the file and the two
    # keys. The file's split, block sizes and first rank are looked up from the file afterwards.
    copies = (prepared.join(F.broadcast(layout), ["_split", "_bucket"])
              .select(*[F.col(q(c)) for c in data_cols], "_shuffle", "_tiebreak", "_file")
              .repartition(len(targets), F.expr(f"element_at({_literal_array(keys)}, _file + 1)")))
    # The order is (_shuffle, _tiebreak): two independent 64-bit hashes of the key and every used
    # raw value. Rows equal in both are, short of a 128-bit collision (about 1e-21 for 1e9 rows),
    # identical input rows, hence identical output rows: any order among them writes the same
    # bytes. (Sorting on every stored column instead made this stage twice as slow.)
    # One sort key that varies from row to row (not a window partitioned by file and bucket,
    # whose sort compares whole rows wherever the constant file key ties), and the position in
    # the sorted partition read from monotonically_increasing_id, with no window at all. The
    # writer checks the result: each file's _row starts at its block's first rank and rises by
    # one from row to row; the driver checks each file's row count.
    sizes = [divmod(counts.split_rows.get(s, 0), n) for s in range(len(split_names)) for _ in range(n)]
    per_file = {"_start": file_starts, "_base": [b for b, _ in sizes], "_extra": [e for _, e in sizes]}
    ordered = copies.sortWithinPartitions(F.expr(_RANK_ORDER), "_tiebreak")
    ranked = ordered.selectExpr("*", *[f"element_at({_literal_array(v)}, _file + 1) AS {k}" for k, v in per_file.items()])
    ranked = ranked.selectExpr(
        "*", f"_start + (monotonically_increasing_id() & {(1 << _POSITION_BITS) - 1}) AS _idx")
    placed = ranked.where(f"_file DIV {n} * {n} + {shard_sql()} = _file").selectExpr(
        *[q(c) for c in data_cols], f"{row_index_sql()} AS {ROW_INDEX}", f"_file AS {TARGET_COLUMN}")
    writer = functools.partial(write_partition, root_uri=staging_uri, targets=targets,
                               schema=arrow_schema(columns), rows_per_row_group=rpg, consecutive=ROW_INDEX,
                               first_values=[start for i in range(len(split_names))
                                             for start in shard_starts(counts.split_rows[i], n)])
    files = [r.asDict(recursive=True) for r in placed.mapInArrow(writer, RESULT_DDL).collect()]
    got = sorted(f["path"] for f in files)
    if got != sorted(targets):
        missing = sorted(set(targets) - set(got))
        raise AccountingError(f"the shard write produced {len(got)} files for {len(targets)} shards "
                              f"(missing {missing[:5]}); nothing was published")
    return files


def _write_quarantine(spark, rows, counts: RowCounts, staging_uri: str) -> list[dict]:
    import pyarrow as pa

    schema = pa.schema([("reason", pa.string()), ("source", pa.string()), ("raw", pa.string())])
    if counts.quarantined == 0:
        return [write_empty(staging_uri, f"{QUARANTINE_DIR}/part-00000.parquet", schema)]
    bad = rows.where("_reason IS NOT NULL").selectExpr("_reason AS reason", "_source AS source", "_raw AS raw")
    num_files = max(1, math.ceil(counts.quarantined / QUARANTINE_ROWS_PER_FILE))
    keys = _partition_keys(num_files)
    targets = [f"{QUARANTINE_DIR}/part-{i:05d}.parquet" for i in range(num_files)]
    writer = functools.partial(write_partition, root_uri=staging_uri, targets=targets, schema=schema,
                               rows_per_row_group=QUARANTINE_ROWS_PER_FILE)
    placed = bad.selectExpr("reason", "source", "raw",
                            f"CAST(pmod(xxhash64(reason, source, raw), {num_files}) AS INT) AS {TARGET_COLUMN}")
    placed = placed.selectExpr("*", f"element_at({_literal_array(keys)}, {TARGET_COLUMN} + 1) AS _pkey")
    written = (placed.repartition(num_files, "_pkey").sortWithinPartitions("reason", "source", "raw")
               .select("reason", "source", "raw", TARGET_COLUMN).mapInArrow(writer, RESULT_DDL).collect())
    return sorted((r.asDict(recursive=True) for r in written), key=lambda f: f["path"])


def _split_entries(split_names: list[str], files: list[dict], counts: RowCounts, num_shards: int) -> dict:
    by_path = {f["path"]: f for f in files}
    splits = {}
    for i, name in enumerate(split_names):
        entries = [by_path[f"{name}/part-{s:05d}.parquet"] for s in range(num_shards)]
        want = shard_sizes(counts.split_rows[i], num_shards)
        got = [f["rows"] for f in entries]
        if got != want:
            raise AccountingError(f"split {name!r}: shard sizes {got} differ from the planned {want}; nothing was published")
        splits[name] = {"rows": sum(got), "files": [
            {"path": f["path"], "rows": f["rows"], "row_groups": list(f["row_groups"]), "bytes": f["bytes"],
             "sha256": f["sha256"]} for f in entries]}
    return splits


def _check_accounting(counts: RowCounts, splits: dict, qfiles: list[dict]) -> dict:
    published = sum(info["rows"] for info in splits.values())
    quarantined = sum(f["rows"] for f in qfiles)
    record = {"input_rows": counts.input_rows, "published_rows": published, "quarantined_rows": quarantined}
    if published + quarantined != counts.input_rows or quarantined != counts.quarantined:
        raise AccountingError(
            f"row accounting does not balance: input {counts.input_rows} != published {published} + quarantined "
            f"{quarantined} (counted {counts.quarantined} bad rows earlier). The input changed while the job ran, or "
            "a transform is not deterministic; nothing was published")
    return record


class _PhaseTimer:
    """One log line per finished phase: the rows it went through, its seconds and rows/s."""

    def __init__(self):
        self.last = time.perf_counter()

    def lap(self) -> float:
        """Seconds since the last phase ended, which starts the next one (logged later with ``report``)."""
        now = time.perf_counter()
        seconds, self.last = now - self.last, now
        return seconds

    def done(self, what: str, rows: int) -> None:
        self.report(what, rows, self.lap())

    @staticmethod
    def report(what: str, rows: int, seconds: float) -> None:
        log.info("%s: %s rows in %.1fs (%s rows/s)", what, f"{rows:,}", seconds, f"{rows / max(seconds, 1e-9):,.0f}")


def _sql_string(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"
