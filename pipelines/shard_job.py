"""The shard job: sources -> Spark SQL -> quarantine -> deterministic split -> balanced shards + manifest.

``run_shard_job(spark, cfg)`` is the one entry point; ``shardtrain shard``, the spark-submit job
file and the notebook API all call it. The order is fixed so that nothing is published until
every check that can fail has passed (what is written before lands in a staging directory that
a failure removes):

0. the output may not be, contain or sit inside a source (a table source: its location, once the
   catalog has said it, in step 1); the output's writer lock is taken (held to the end) and
   staging left by killed jobs is removed;
1. mode check (``common.output_mode``: ``error`` refuses, ``skip_if_exists`` compares the input
   fingerprint and returns, ``overwrite`` accepts only a dataset at the path), and for
   ``overwrite`` none that a training run reads (a live reader lease, ``common.leases``, unless
   ``output.ignore_readers``; checked again before the commit);
2. read sources, build the table (query, transform), check columns and types; with
   ``label.classes: auto``, fit the class list on the train split's clean rows (one Spark
   aggregation, a read of the input of its own: pipelines/labels.py), so that pass one already
   quarantines the val and test rows of other classes;
3. inside ``publish.publish`` (a staging directory, removed on any failure), pass one over the
   rows: evaluate the row expressions once, send each checked row (split, keys, typed values,
   reason; malformed records too) to its staging partition, a split's range of buckets or the
   bad rows (one shuffle), and there write it as Parquet under the staging directory and take
   the summary (pipelines/summary.py): rows per split, bucket and quarantine reason, and over
   the train split the exact moments, value counts, class counts and each feature's nulls (the
   manifest's ``null_share``, what the score job compares its input with). With ``teacher``, its soft
   targets are computed there too (pipelines/teacher.py; the model's description was read and
   checked before step 1). The staged rows are removed before the commit;
4. quality gate, and every split must have at least num_shards rows; the statistics and
   vocabularies from the summary;
5. pass two: one task per output file reads the staged files of its buckets, ranks the rows,
   keeps its block, encodes it (``FeatureSpec``) and writes it with pyarrow (shard_writer.py);
   write the quarantine, check input = published + quarantined, write the manifest and config;
   commit.

A small job (sources under ``SMALL_INPUT_BYTES``) runs the same steps in fewer Spark jobs and
tasks, since there each one's fixed cost outweighs the parallelism (``JobShape``): one staging
partition per split, its row count checked from pass one's counts, and pass two's files, the
quarantine's among them, written by at most one task per core in one job. The bytes written are
the same either way (tests/pipelines/test_shard_job.py, benchmarks/shard_small.py).

Where rows and work go (staging keys, partition keys, each file's buckets and block of ranks,
the small job's tasks) is pipelines/shard_placement.py's, computed on the driver from pass one's
counts: ranking and placement need no global sort, no driver collect and one shuffle. The checks
of steps 4 and 5 on the counts and the written files are pipelines/shard_checks.py's; this module
runs the steps in order.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass

from common import __version__
from pipelines.balance import BUCKET_BITS, check_input_rows, rows_per_row_group
from common.config import dump_yaml, to_dict
from common.plugins import load_callable
from common.errors import AccountingError, InputDataError, OutputLockedError, first_line
from common.leases import active_readers, describe_reader, readers_location
from common.dataset import FORMAT_VERSION, LABEL_NAME, Manifest, read_manifest, ROW_INDEX, TEACHER_COLUMN, TeacherRecord
from common.manifest_builder import arrow_schema, build_manifest, row_bytes, write_manifest
from common.features import KINDS, FeatureSpec
from common.sql import quote_identifier as q
from common.sql import quote_string
from common.sources import CORRUPT_COLUMN, MALFORMED, check_table_inputs, read_sources, source_fingerprint
from pipelines.preprocess import (check_table, configured_features, fit, prepared_table, raw_text_sql, row_columns,
                                  scan_columns, stored_schema, typed_features)
from pipelines.shard_checks import check_accounting, check_counts, count_transfer_rows, split_entries
from pipelines.shard_config import ShardConfig
from pipelines.shard_placement import (JobShape, RowCounts, StagedRows, check_partitions, deal_to_tasks,
                                       partition_key_sql, shard_plans, stage_key_sql, staging_parts)
from pipelines import summary as summary_module
from pipelines.summary import ScanSpec, Summary
from pipelines.shard_writer import (RESULT_DDL, STAGE_COLUMN, STAGE_RESULT_DDL, TARGET_COLUMN, Encoding,
                                    QuarantinePlan, file_digest, stage_partition, write_empty, write_partition,
                                    write_shards)
from pipelines.labels import fit_classes
from pipelines.teacher import TeacherScorer, check_teacher, teacher_record, with_teacher
from common.commit_marker import KIND_DATASET
from common.output_mode import REPLACE, SAME, OutputWords, existing_output
from common.output_guard import check_disjoint, check_output_uri
from common.publish import clean_stale_staging, publish
from common.storage import resolve, storage_errors
from common.writer_lock import output_lock

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
    from common.config import with_absolute_paths
    from common.spark import check_paths_reach_cluster

    cfg = with_absolute_paths(cfg)
    check_paths_reach_cluster(cfg, spark)
    out = resolve(cfg.output.path)
    check_output_path(cfg)
    with output_lock(out.uri):
        clean_stale_staging(out.uri)  # left by killed jobs; we hold the lock, so no live job owns it
        return _run_locked(spark, cfg, out, teacher_scorer)


def check_output_path(cfg: ShardConfig) -> None:
    """output.path must not be, contain or sit inside a source (exit 2, before any work)."""
    inputs = {f"source {name!r} (sources.{name}.path)": src.path for name, src in cfg.sources.items()
              if src.path is not None}  # a table's location is known once the catalog is asked (check_table_inputs)
    if cfg.teacher is not None:
        inputs["the teacher model (teacher.model)"] = cfg.teacher.model
    check_output_uri(cfg.output.path, "output.path")
    check_disjoint(cfg.output.path, "output.path", inputs)


def _run_locked(spark, cfg: ShardConfig, out, teacher_scorer: TeacherScorer | None) -> ShardResult:

    teacher = teacher_record(cfg, teacher_scorer)  # None without cfg.teacher
    sources_fp = {name: source_fingerprint(name, src, spark) for name, src in cfg.sources.items()}
    check_table_inputs(cfg.output.path, "output.path", sources_fp)
    input_fp = input_fingerprint(cfg, sources_fp, teacher)
    existing = _check_existing(out, cfg, input_fp)
    if existing is not None:
        log.info("%s already holds this dataset (input fingerprint %s); skipping", out.uri, input_fp[:12])
        return ShardResult(uri=out.uri, manifest=existing, skipped=True)

    frames = read_sources(spark, cfg.sources)
    try:
        return _run_passes(spark, cfg, out, frames, sources_fp, input_fp, teacher, teacher_scorer)
    finally:
        for frame in frames.values():
            frame.release()


def _run_passes(spark, cfg: ShardConfig, out, frames, sources_fp: dict, input_fp: str, teacher: TeacherRecord | None,
                teacher_scorer: TeacherScorer | None) -> ShardResult:
    from common.spark import default_parallelism, spark_errors

    table, where = _build_table(spark, cfg, frames)
    check_table(table, cfg, where)
    table = prepared_table(table, cfg, check_partitions(sources_fp, default_parallelism(spark)))
    recorded = cfg  # what the manifest and config.yaml record: the user's config (classes: auto stays auto)
    cfg = _with_classes(table, cfg, teacher)
    cfg = _with_fitted_rules(table, cfg)
    shape = JobShape.of(spark, cfg, sources_fp)
    # One source's table is checked for num_shards rows before the split checks: a query's or a
    # transform's table may cost a whole pass to count, so there the split check below decides.
    check_rows_first = cfg.query is None and cfg.transform is None
    if check_rows_first and not shape.small:
        _check_first_rows(table, cfg, where)
    with spark_errors("building the row checks and split columns"):
        checked = _checked_rows(table, cfg, frames)
    timer = _PhaseTimer()
    mode = "overwrite" if cfg.output.mode == "overwrite" else "error"
    # Everything from here on happens inside the staging directory: a failed check (quality gate,
    # split sizes, accounting) removes it with whatever was written, and the output is untouched.
    with publish(out.uri, mode=mode, marker={"kind": KIND_DATASET, "input_fingerprint": input_fp}) as staging:
        with spark_errors("reading, checking and staging the input rows"):
            staged, counts, summary = _stage_rows(spark, checked, cfg, staging.uri, teacher_scorer, teacher, shape)
        for frame in frames.values():
            frame.release()  # only pass one reads the sources
        timer.done("read, check, stage and count rows", counts.input_rows)
        if check_rows_first and shape.small:
            check_input_rows(where, min(counts.table_rows, cfg.output.num_shards), cfg.output.num_shards)
        check_counts(cfg, counts)
        stats, features, transfer_rows = _fit_train(spark, cfg, staged, counts, summary, timer)
        columns = stored_schema(cfg, teacher)
        # Encoded columns (an image's bytes) count with the mean stored bytes their fit measured.
        rpg = rows_per_row_group(cfg.output.rows_per_row_group, cfg.output.row_group_mb, row_bytes(columns, features))
        splits, qfiles = _pass_two(spark, staging, staged, cfg, counts, features, columns, rpg, shape, timer)
        accounting = check_accounting(counts, splits, qfiles)
        if cfg.label.unlabeled == "transfer":
            accounting["transfer_rows"] = transfer_rows  # published, in the train split
        _write_feature_files(staging, features)
        manifest = build_manifest(
            splits, FeatureSpec(features).published(), stats.label, teacher=None if teacher is None else teacher.to_record(),
            num_shards=cfg.output.num_shards, rows_per_row_group=rpg,
            quarantine={"path": QUARANTINE_DIR, "rows": counts.quarantined,
                        "by_reason": dict(sorted(counts.by_reason.items())), "files": qfiles},
            accounting=accounting, sources=sources_fp, config=to_dict(recorded), input_fingerprint=input_fp)
        if manifest["schema"] != columns:
            raise AccountingError(f"the written columns {columns} differ from the manifest schema "
                                  f"{manifest['schema']}; nothing was published")
        write_manifest(staging, manifest)
        staging.write_text(CONFIG_NAME, dump_yaml(recorded))
        if cfg.output.mode == "overwrite":
            check_no_readers(out.uri, cfg)  # again, just before the commit: a training may have started since
    log.info("published %s: %s%s", out.uri, ", ".join(f"{s}={v['rows']}" for s, v in splits.items()),
             f" ({transfer_rows} of train without a label: the transfer set)" if transfer_rows else "")
    return ShardResult(uri=out.uri, manifest=read_manifest(out.uri), skipped=False)


def _with_classes(table, cfg: ShardConfig, teacher: TeacherRecord | None) -> ShardConfig:
    """``cfg`` with ``label.classes: auto`` fitted on the train split (pipelines/labels.py: one Spark
    aggregation before pass one, so that pass one quarantines val and test rows of other classes),
    and the teacher checked against them; ``cfg`` itself where the classes are not to be fitted."""
    from common.spark import spark_errors

    if cfg.label.classes != "auto":
        return cfg
    with spark_errors("fitting the label's classes on the train split"):
        cfg = fit_classes(table.selectExpr(*row_columns(table, cfg)), cfg)
    if teacher is not None:
        check_teacher(teacher, cfg)
    return cfg


def _with_fitted_rules(table, cfg: ShardConfig) -> ShardConfig:
    """``cfg`` with what the kinds' row rules need fitted on the train split (a text feature's
    tokenizer: ``FeatureKind.fit_before_rows``), from the rows that pass every rule not needing it
    (a read of the input of its own, like ``label.classes: auto``); ``cfg`` itself where none does."""
    import copy

    from common.spark import spark_errors

    kinds = [kind for kind in KINDS if kind.fits_before_rows(cfg.features)]
    if not kinds:
        return cfg
    train = list(cfg.split.fractions).index("train")
    features = copy.deepcopy(cfg.features)
    with spark_errors("fitting the text tokenizers on the train split"):
        clean = table.selectExpr(*row_columns(table, cfg)).where(f"_split = {train} AND _reason IS NULL")
        for kind in kinds:
            kind.fit_before_rows(features, clean, int(cfg.split.seed))
    fitted = copy.copy(cfg)
    fitted.features = features
    return fitted


def _write_feature_files(staging, features: list[dict]) -> None:
    """The kinds' side files (a tokenizer.json) into the staging directory, published with the shards."""
    for path, text in FeatureSpec(features).file_texts().items():
        staging.write_text(path, text)


def _check_first_rows(table, cfg: ShardConfig, where: str) -> None:
    """A scan that reads no column and stops at num_shards rows: cheap, and it spares a large
    input's whole first pass. A small input's first pass counts its rows anyway (_run_passes)."""
    from pyspark.sql import functions as F

    from common.spark import spark_errors

    with spark_errors("counting the input's first rows"):
        seen = table.select(F.lit(1)).limit(cfg.output.num_shards).count()
    check_input_rows(where, seen, cfg.output.num_shards)


def _fit_train(spark, cfg: ShardConfig, staged: StagedRows, counts: RowCounts, summary: Summary, timer: "_PhaseTimer"):
    """(the statistics and vocabularies fitted on the train split, the manifest's features from
    them, the train rows without a label): from pass one's summary, the staged train rows read
    only where it is not enough (``preprocess.fit``)."""
    from common.spark import spark_errors

    train = list(cfg.split.fractions).index("train")
    with spark_errors("fitting statistics and vocabularies on the train split"):
        stats = fit(lambda: staged.frame(spark, staged.split_paths(train)), cfg, summary)
    timer.done("fit statistics and vocabularies on train", counts.split_rows.get(train, 0))
    transfer_rows = count_transfer_rows(cfg, counts.split_rows.get(train, 0), summary)
    if cfg.label.unlabeled == "transfer":
        stats.label.update(unlabeled="transfer", train_transfer_rows=transfer_rows)
    features = stats.features
    return stats, features, transfer_rows


def _pass_two(spark, staging, staged: StagedRows, cfg: ShardConfig, counts: RowCounts, features: dict,
              columns: list[dict], rpg: int, shape: JobShape, timer: "_PhaseTimer") -> tuple[dict, list[dict]]:
    """(the splits' manifest entries, the quarantine's files): the balanced shards and the
    quarantine written into the staging directory, the staged rows and what killed write attempts
    left removed, and each split's files checked against their planned sizes."""
    from common.spark import spark_errors

    split_names = list(cfg.split.fractions)
    with spark_errors("writing the balanced shards"):
        files, qfiles = _write_shards(spark, staged, cfg, counts, features, columns, rpg, shape)
    timer.done("write balanced shards", sum(counts.split_rows.values()))
    if qfiles is None:
        with spark_errors("writing the quarantine"):
            qfiles = _write_quarantine(spark, staged, counts)
        timer.done("write quarantine", counts.quarantined)
    _remove_staged_rows(staging)
    _remove_temporaries(staging, [*split_names, QUARANTINE_DIR])
    return split_entries(split_names, files, counts, cfg.output.num_shards), qfiles


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
               f"WHEN _reason IS NOT NULL THEN {raw_text_sql(data_columns, cfg)} END")
        return _kept_columns(checked, parse.columns, reason, raw, quote_string(next(iter(frames))))
    for frame in frames.values():
        frame.persist()  # the table and the malformed records each read the parse: parse once
    checked = table.selectExpr(*row_columns(table, cfg))
    raw = f"CASE WHEN _reason IS NOT NULL THEN {raw_text_sql(table.columns, cfg)} END"
    # Row-level reasons name the table's source, or "query" for a query's rows.
    source = "query" if cfg.query is not None else next(iter(frames))
    rows = _kept_columns(checked, table.columns, "_reason", raw, quote_string(source))
    for frame in frames.values():
        if frame.malformed is not None:
            rows = rows.unionByName(frame.malformed.selectExpr("reason AS _reason", "raw AS _raw", "source AS _source"),
                                    allowMissingColumns=True)
    return rows


def _single_parse(cfg: ShardConfig, frames):
    """The parse of the one CSV/JSON source when the table is its clean rows as they are."""
    if cfg.query is not None or cfg.transform is not None:
        return None
    (frame,) = frames.values()
    return frame.parsed


def _kept_columns(checked, table_columns: list[str], reason: str, raw: str, source: str):
    kept = [c for c in checked.columns if c not in set(table_columns) and c != "_reason"]
    return checked.selectExpr(
        *[q(c) for c in kept], f"CAST(shiftrightunsigned(_shuffle, {64 - BUCKET_BITS}) AS INT) AS _bucket",
        f"{reason} AS _reason", f"{raw} AS _raw", f"CASE WHEN {reason} IS NOT NULL THEN {source} END AS _source")


def _stage_rows(spark, checked, cfg: ShardConfig, staging_uri: str, teacher_scorer: TeacherScorer | None,
                teacher: TeacherRecord | None, shape: JobShape) -> tuple[StagedRows, RowCounts, Summary]:
    """Pass one over the rows: evaluate the row checks once, send each row to its staging key's
    partition (one shuffle), and there write the rows as one Parquet file and take their summary
    (pipelines/summary.py), in the same task. Returns the files, the counts and the summary.

    The shuffle is the one a shard file needs: a split's bucket range holds the rows of about
    one output file (the files are contiguous blocks of ranks, buckets hold about equal shares),
    so the second pass reads one or a few staged files per output file and no Spark shuffle,
    sort or conversion of the rows to Python is left for it. A Parquet staging write cost no more than
    the cache of the same rows (benchmarks/RESULTS.md, issue 11), and a task retried later
    re-reads the same files, so it sees the same rows. Removed before the commit.

    With ``teacher``, its soft targets are computed here, on each partition's clean rows sorted
    by content (pipelines/teacher.py): partitions and batches then depend on the rows alone.
    """
    from pyspark.sql import functions as F

    num_splits, parts = len(cfg.split.fractions), staging_parts(cfg, shape)
    num_partitions = (num_splits + 1) * parts
    rows = checked.selectExpr("*", f"{stage_key_sql(num_splits, parts)} AS {STAGE_COLUMN}")
    placed = rows.repartition(num_partitions, F.expr(partition_key_sql(num_partitions, STAGE_COLUMN)))
    if cfg.teacher is not None:
        from pyspark import StorageLevel

        # The teacher scores the clean rows and passes the bad ones (two branches over the same
        # partitions): kept, so that the input is read, checked and shuffled once.
        placed.persist(StorageLevel.MEMORY_AND_DISK)
    try:
        return _write_staged(with_teacher(placed, cfg, teacher_scorer, teacher), cfg, staging_uri, parts)
    finally:
        if cfg.teacher is not None:
            placed.unpersist()


def _write_staged(rows, cfg: ShardConfig, staging_uri: str, parts: int) -> tuple[StagedRows, RowCounts, Summary]:
    num_splits = len(cfg.split.fractions)
    label = cfg.label
    moments, counted = scan_columns(cfg)
    scan = ScanSpec(split="_split", bucket="_bucket", reason="_reason", moments=moments, categorical=counted,
                    label="_label" if label.classification else None, num_classes=label.num_classes or 0,
                    selected=list(cfg.split.fractions).index("train"), num_splits=num_splits, bucket_bits=BUCKET_BITS,
                    max_distinct=summary_module.MAX_DISTINCT_PER_PARTITION, nulls=typed_features(cfg))
    writer = functools.partial(stage_partition, root_uri=staging_uri, directory=STAGED_ROWS_DIR, scan=scan)
    written = rows.mapInArrow(writer, STAGE_RESULT_DDL).collect()
    staged = StagedRows(uri=staging_uri, files={r["stage"]: r["path"] for r in written}, parts=parts,
                        num_splits=num_splits)
    if len(staged.files) != len(written):
        raise AccountingError("two staging tasks wrote the same staging key; the driver's partition keys are wrong")
    summary = scan.merge([r["summary"] for r in written], names=list(moments))
    return staged, _counts(summary), summary


def _remove_staged_rows(staging) -> None:
    loc = staging.join(STAGED_ROWS_DIR)
    with storage_errors("removing the staged rows", loc.uri):
        loc.fs.rm(loc.path, recursive=True)


def _remove_temporaries(staging, directories: list[str]) -> None:
    """Remove what a killed write attempt left (``<file>.tmp-<id>``, shard_writer._atomic_file):
    its retry wrote the file itself, and nothing half-written may be published with it."""
    for name in directories:
        loc = staging.join(name)
        with storage_errors("removing temporary files of killed write attempts", loc.uri):
            if not loc.fs.exists(loc.path):
                continue
            for path in loc.fs.ls(loc.path, detail=False):
                if ".tmp-" in path.rsplit("/", 1)[-1]:
                    loc.fs.rm(path)


def input_fingerprint(cfg: ShardConfig, sources_fp: dict, teacher: TeacherRecord | None = None) -> str:
    """What the output is a function of: the config (minus how it runs), the input files, and the
    teacher model's own fingerprint (a model replaced at the same URI gives other soft targets)."""
    config = to_dict(cfg)
    config.pop("spark", None)
    config["output"].pop("mode", None)
    config["output"].pop("staging_partitions", None)  # how the job runs, not what it writes
    config["output"].pop("ignore_readers", None)
    if config.get("teacher"):
        config["teacher"].pop("model_code", None)  # whether its code may run, not what it scores
    payload = {"config": config, "sources": sources_fp, "shardtrain_version": __version__,
               "format_version": FORMAT_VERSION}
    if teacher is not None:
        payload["teacher_fingerprint"] = teacher.fingerprint
    files = {key: uri for kind in KINDS for key, uri in kind.input_files(cfg.features).items()}
    if files:  # a file the kinds read (a tokenizer): its bytes, not only its URI, are the input
        payload["feature_files"] = {key: _file_sha256(uri, key) for key, uri in sorted(files.items())}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _file_sha256(uri: str, key: str) -> str:
    loc = resolve(uri)
    with storage_errors(f"reading {key}", uri):  # any other OSError: one line naming the path (exit 1)
        try:
            return file_digest(loc.fs, loc.path)[1]
        except FileNotFoundError:  # before storage_errors makes it an OSError's exit 1: the input is missing
            raise InputDataError(f"{key}: {uri} does not exist") from None


_DATASET = OutputWords(kind=KIND_DATASET, identical="an identical one", committed="a committed dataset",
                       other="a different dataset", inputs="the config or the source files")


def _check_existing(out, cfg: ShardConfig, input_fp: str) -> Manifest | None:
    """The dataset already at the output when skip_if_exists finds this one; None to go on."""
    found = existing_output(out, cfg.output.mode, _DATASET, input_fp)
    if found == SAME:
        return read_manifest(out)
    if found == REPLACE:
        check_no_readers(out.uri, cfg)
    return None


def check_no_readers(uri: str, cfg: ShardConfig) -> None:
    """overwrite: no training run may be reading the dataset (a live reader lease,
    ``common.leases``), or OutputLockedError (exit 1, retry when it is done) names the reader;
    ``output.ignore_readers: true`` overwrites anyway, and those runs then fail."""
    readers = active_readers(uri)
    if not readers:
        return
    who = "; ".join(describe_reader(r) for r in readers)
    if cfg.output.ignore_readers:
        log.warning("%s: overwriting it while %d training run(s) read it (%s), as output.ignore_readers=true says; "
                    "they will fail", uri, len(readers), who)
        return
    raise OutputLockedError(
        f"{uri} is being read by {len(readers)} training run(s): {who} (leases in {readers_location(uri).uri}); "
        "overwriting it would fail them: wait for them to finish, or set output.ignore_readers=true to overwrite "
        "anyway")


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
        where = f"source {name!r} ({frame.config.location})"
        table = frame.clean
    if cfg.transform is not None:
        func = load_callable(cfg.transform, "transform")
        with spark_errors(f"transform {cfg.transform}"):
            table = func(table)
        where = f"the table returned by transform {cfg.transform!r}"
    return table, where


def _counts(summary: Summary) -> RowCounts:
    """Rows per split, (split, bucket) and reason, from the staging pass's summary."""
    split_rows: dict[int, int] = {}
    for (s, _), n in summary.bucket_rows.items():
        split_rows[s] = split_rows.get(s, 0) + n
    by_reason = summary.by_reason
    malformed = by_reason.get(MALFORMED, 0)  # staged with the rows (_checked_rows)
    table_rows = sum(split_rows.values()) + sum(by_reason.values()) - malformed
    return RowCounts(split_rows, summary.bucket_rows, by_reason, table_rows, malformed)


def _write_shards(spark, staged: StagedRows, cfg: ShardConfig, counts: RowCounts, features: dict,
                  columns: list[dict], rpg: int, shape: JobShape) -> tuple[list[dict], list[dict] | None]:
    """Pass two: one task per output file reads its buckets' staged rows, ranks, encodes and
    writes them (shard_writer.write_shards); no shuffle. A small job runs at most ``cores`` tasks,
    the files dealt out by size, and writes the quarantine in the same job (then returned as the
    second value, else None: ``_write_quarantine`` writes it). The driver checks every file arrived."""
    n = cfg.output.num_shards
    split_names = list(cfg.split.fractions)
    targets = [f"{split}/part-{s:05d}.parquet" for split in split_names for s in range(n)]
    plans = shard_plans(staged, counts, len(split_names), n)
    quarantine = _quarantine_plan(staged, counts) if shape.small else None
    sizes = [plan.bucket_rows for plan in plans] + ([quarantine.rows] if quarantine is not None else [])
    tasks = min(len(sizes), shape.cores) if shape.small else len(sizes)
    assignments = deal_to_tasks(sizes, tasks)
    writer = functools.partial(write_shards, root_uri=staged.uri, plans=plans, targets=targets,
                               encoding=_encoding(cfg, features, columns), schema=arrow_schema(columns),
                               rows_per_row_group=rpg, assignments=assignments, quarantine=quarantine)
    ids = spark.range(0, len(assignments), 1, len(assignments)).selectExpr("CAST(id AS INT) AS id")
    written = [r.asDict(recursive=True) for r in ids.mapInArrow(writer, RESULT_DDL).collect()]
    files = [f for f in written if not f["path"].startswith(QUARANTINE_DIR + "/")]
    got = sorted(f["path"] for f in files)
    if got != sorted(targets):
        missing = sorted(set(targets) - set(got))
        raise AccountingError(f"the shard write produced {len(got)} files for {len(targets)} shards "
                              f"(missing {missing[:5]}); nothing was published")
    if quarantine is None:
        return files, None
    qfiles = [f for f in written if f["path"].startswith(QUARANTINE_DIR + "/")]
    if [f["path"] for f in qfiles] != [quarantine.path]:
        raise AccountingError(f"the shard write produced quarantine files {[f['path'] for f in qfiles]} for "
                              f"{[quarantine.path]}; nothing was published")
    return files, qfiles


def _quarantine_plan(staged: StagedRows, counts: RowCounts) -> QuarantinePlan | None:
    """The quarantine as a file for pass two's job to write: when it has rows and they fit one
    file (an empty one is written on the driver, a larger one by ``_write_quarantine``)."""
    if counts.quarantined == 0 or counts.quarantined > QUARANTINE_ROWS_PER_FILE:
        return None
    if not staged.bad_paths():
        raise AccountingError(f"the count found {counts.quarantined} bad rows, but the staging pass wrote none; "
                              "nothing was published")
    return QuarantinePlan(path=f"{QUARANTINE_DIR}/part-00000.parquet", inputs=tuple(staged.bad_paths()),
                          rows=counts.quarantined, schema=_quarantine_schema(),
                          rows_per_row_group=QUARANTINE_ROWS_PER_FILE)


def _encoding(cfg: ShardConfig, features: dict, columns: list[dict]) -> Encoding:
    """Each stored column's staged source: features as their kinds store them (with the fitted
    statistics), the teacher's soft targets copied as staged, the label too (a transfer row's null
    as its task's ``missing_label``)."""
    how = {name: ("feature", kind.typed(name)) for kind in configured_features(cfg).kinds for name in kind.names}
    how.update({LABEL_NAME: ("label", "_label"), TEACHER_COLUMN: ("copy", TEACHER_COLUMN)})
    return Encoding(features=features,
                    columns=tuple((c["name"], *how[c["name"]]) for c in columns if c["name"] != ROW_INDEX),
                    task=cfg.label.task)


def _quarantine_schema():
    import pyarrow as pa

    return pa.schema([("reason", pa.string()), ("source", pa.string()), ("raw", pa.string())])


def _write_quarantine(spark, staged: StagedRows, counts: RowCounts) -> list[dict]:
    """The quarantine by a Spark job of its own (``_write_shards`` writes a small job's): the bad
    rows placed into files by a hash, each file sorted by (reason, source, raw)."""
    staging_uri = staged.uri
    schema = _quarantine_schema()
    if counts.quarantined == 0:
        return [write_empty(staging_uri, f"{QUARANTINE_DIR}/part-00000.parquet", schema)]
    if not staged.bad_paths():
        raise AccountingError(f"the count found {counts.quarantined} bad rows, but the staging pass wrote none; "
                              "nothing was published")
    rows = staged.frame(spark, staged.bad_paths())
    bad = rows.selectExpr("_reason AS reason", "_source AS source", "_raw AS raw")
    num_files = max(1, math.ceil(counts.quarantined / QUARANTINE_ROWS_PER_FILE))
    targets = [f"{QUARANTINE_DIR}/part-{i:05d}.parquet" for i in range(num_files)]
    writer = functools.partial(write_partition, root_uri=staging_uri, targets=targets, schema=schema,
                               rows_per_row_group=QUARANTINE_ROWS_PER_FILE)
    placed = bad.selectExpr("reason", "source", "raw",
                            f"CAST(pmod(xxhash64(reason, source, raw), {num_files}) AS INT) AS {TARGET_COLUMN}")
    placed = placed.selectExpr("*", f"{partition_key_sql(num_files, TARGET_COLUMN)} AS _pkey")
    written = (placed.repartition(num_files, "_pkey").sortWithinPartitions("reason", "source", "raw")
               .select("reason", "source", "raw", TARGET_COLUMN).mapInArrow(writer, RESULT_DDL).collect())
    return sorted((r.asDict(recursive=True) for r in written), key=lambda f: f["path"])


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
