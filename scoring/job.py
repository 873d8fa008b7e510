"""The score job: a published model over raw sources (or a published dataset) -> a scores output.

``run_score_job(spark, cfg)`` is the one entry point (``shardtrain score``, the spark-submit job
file, notebooks). Nothing is written until every check that can fail has passed:

0. the output may not be, contain or sit inside an input (the model, the sources, the dataset);
   the output's writer lock is taken (held to the end) and staging left by killed jobs removed;
1. mode check (``common.output_mode``): ``error`` refuses an existing output,
   ``skip_if_exists`` returns when the output holds scores of the same input fingerprint
   (config, input files, model), ``overwrite`` replaces only a scores output (marker kind
   ``shardtrain.scores``); up to here no Spark is needed unless a source or the output is a
   table, so a job given no session starts Spark only after this step;
2. the input table: the shard job's sources and query (``common.sources``; CSV/JSON records
   that do not parse are quarantined as ``malformed_record``), or the dataset split's stored
   encodings, after checking the model was fitted on the same encodings (``FeatureSpec.encoding``)
   and every file against its manifest sha256;
3. every feature the model reads is checked against the input's schema (present, of a type its
   preprocessing takes: exit 2 naming the column);
4. inside ``publish.publish``: the clean rows are scored (``predict_frame``) and written as
   Parquet at the output's root; that same pass counts every row by quarantine reason
   (``scoring.predict.reason_sql``, observed as it reads the rows: no counting job of its own). An
   empty input is refused then (nothing published), and each feature's nulls, counted by the
   same pass, are compared with the model's train split (``scoring.quality``: a warning past
   ``quality.max_null_increase``, a refusal, nothing published, past ``quality.fail_null_increase``;
   both shares in ``_scores.json``'s ``null_share``). The bad rows go under ``_quarantine/``
   (``reason``, ``source``, ``raw`` as JSON, as the shard job writes them): written by a second
   pass over the input only when the count found any, else the same empty file from no rows. The
   rows in the written files must add up to the counts (scored = clean, quarantined = bad) before
   the marker is written: an input that changed between the two passes is refused.

With ``output.table`` the scores go to that catalog table instead, published atomically
(``common.tables``: written to a staging table, counted, then swapped in by rename, or as a new
version of a Delta table) just before the output path commits; the path keeps everything else
(``_scores.json`` with the accounting, the config, ``_quarantine/``, the marker and the writer
lock), so the quarantine of a table's scores is ``<output.path>/_quarantine``. The table carries
the input fingerprint as a table property (``shardtrain.input_fingerprint``): ``skip_if_exists``
skips only when the path and the table both hold this input's scores; ``overwrite`` replaces only
a table a score job wrote (``shardtrain.kind``).

A ``models:/NAME@ALIAS`` model is resolved to one version first; the marker and
``_scores.json`` record it (``model_version``). With ``skip_if_exists``, scores of the same
config and input by the version the alias named before are replaced (the alias moved: the input
is scored again); with ``models:/NAME/VERSION`` the scores stay as they are.
"""

from __future__ import annotations

import hashlib
import json
import logging
import posixpath
from dataclasses import dataclass, field

from common import __version__
from common.config import dump_yaml, to_dict
from common.sources import check_table_inputs
from common.errors import AccountingError, ConfigError, DatasetError, InputDataError, OutputExistsError, first_line
from common.output_mode import SAME, OutputWords, existing_output
from common.model_registry import RegistryModel, is_registry_uri, resolve_registry_model
from common.tables import (FINGERPRINT_PROPERTY, KIND_PROPERTY, clean_stale_tables, swap_in, table_exists,
                           quote_table, table_properties, write_staging_table)
from common.commit_marker import KIND_SCORES, is_committed
from common.output_guard import check_disjoint, check_output_uri
from common.publish import clean_stale_staging, publish, read_marker
from common.storage import resolve
from common.writer_lock import output_lock
from scoring.config import ScoreConfig
from common.rows import raw_json_sql
from scoring.predict import REASON, check_feature_types, predict_frame, prepared_frame, reason_sql, reason_values
from scoring.quality import compare_null_shares, observe_nulls

log = logging.getLogger("shardtrain.score")

QUARANTINE_DIR = "_quarantine"
SUMMARY_NAME = "_scores.json"
CONFIG_NAME = "_config.yaml"  # "_": Spark and pyarrow read the output folder as Parquet, and skip it


@dataclass
class ScoreResult:
    uri: str
    input_rows: int
    scored_rows: int
    quarantined_rows: int
    by_reason: dict[str, int] = field(default_factory=dict)
    skipped: bool = False
    table: str | None = None  # output.table, where the scores are (the accounting and quarantine at uri)

    def summary(self) -> str:
        where = f"table {self.table} (accounting in {self.uri})" if self.table else self.uri
        if self.skipped:
            return f"unchanged, skipped {where}: scores of this input and model are already there"
        reasons = ", ".join(f"{r}={n:,}" for r, n in sorted(self.by_reason.items()))
        return (f"published {where}: {self.scored_rows:,} of {self.input_rows:,} rows scored; quarantined "
                f"{self.quarantined_rows:,}" + (f" ({reasons}) under {self.uri}/{QUARANTINE_DIR}" if reasons else ""))


def run_score_job(spark, cfg: ScoreConfig) -> ScoreResult:
    """Run the job under the output's writer lock (a second writer fails, naming this one).

    ``spark``: the session, or None for ``cfg.spark``'s, started only once the job needs Spark (a
    table source or output, or rows to score): a job that finds its scores already there, or is
    refused by its output's mode or lock, starts no JVM."""
    from common.config import with_absolute_paths
    from common.spark import check_paths_reach_cluster

    cfg = with_absolute_paths(cfg)
    check_paths_reach_cluster(cfg, spark)  # a remote Spark Connect server: none of this machine's paths
    check_output_path(cfg)
    out = resolve(cfg.output.path)
    with output_lock(out.uri):
        clean_stale_staging(out.uri)  # left by killed jobs; we hold the lock, so no live job owns it
        return _run_locked(_SessionWhenNeeded(spark, cfg), cfg, out)


class _SessionWhenNeeded:
    """The job's session: the caller's, or ``cfg.spark``'s, made on the first call."""

    def __init__(self, spark, cfg: ScoreConfig):
        self._spark, self._cfg = spark, cfg

    def __call__(self):
        if self._spark is None:
            from common.spark import get_or_create_session

            self._spark = get_or_create_session(self._cfg.spark)
        return self._spark


def check_output_path(cfg: ScoreConfig) -> None:
    """output.path must not be, contain or sit inside an input (exit 2, before any work)."""
    check_output_uri(cfg.output.path, "output.path")
    check_disjoint(cfg.output.path, "output.path", cfg.inputs)


def _run_locked(session: _SessionWhenNeeded, cfg: ScoreConfig, out) -> ScoreResult:
    model = _resolve_model(cfg)
    tables = any(src.table is not None for src in cfg.sources.values())
    input_record = _input_record(cfg, session() if tables else None)  # a table's fingerprint is its catalog's
    if "sources" in input_record:
        check_table_inputs(cfg.output.path, "output.path", input_record["sources"])
    input_fp = input_fingerprint(cfg, input_record, model.marker)
    mode = _output_mode(session, cfg, out, model, input_record, input_fp)
    existing = _check_existing(out, cfg, input_fp, mode)
    if existing is not None:
        log.info("%s already holds these scores (input fingerprint %s); skipping", out.uri, input_fp[:12])
        return existing

    spark = session()
    scoring = _checked_input(spark, cfg, model.load(cfg).features)
    marker = {"kind": KIND_SCORES, "input_fingerprint": input_fp, "model": cfg.model,
              "model_json_sha256": model.sha256, **model.version_record()}
    mode = "overwrite" if mode == "overwrite" else "error"
    with publish(out.uri, mode=mode, marker=marker) as staging:
        counted = _score_into(staging, spark, cfg, out, model, scoring, {"input_fingerprint": input_fp,
                                                                          "input": input_record})
    result = ScoreResult(uri=out.uri, input_rows=counted.input_rows, scored_rows=counted.clean_rows,
                         quarantined_rows=counted.quarantined, by_reason=dict(sorted(counted.by_reason.items())),
                         table=cfg.output.table)
    log.info("%s", result.summary())
    return result


@dataclass
class _Model:
    """The model the whole job scores with: a registered one (``models:/``) resolved to one version, once."""

    uri: str  # what is loaded: the path, or the registered version's pinned models:/NAME/VERSION
    registry_uri: str | None
    marker: dict  # its commit marker (or, downloaded, its model.json digest): the input fingerprint's part
    registered: RegistryModel | None = None
    loaded: object | None = None  # a registered model downloaded for its identity, kept for the job

    @property
    def sha256(self) -> str | None:
        return self.marker.get("model_json_sha256")

    def version_record(self) -> dict:
        """The registered version, as the marker and ``_scores.json`` record it ({} for a path)."""
        return {"model_version": self.registered.record()} if self.registered is not None else {}

    def load(self, cfg: ScoreConfig):
        from training import load_model

        return self.loaded or load_model(self.uri, program=cfg.program, registry_uri=self.registry_uri,
                                         trust_code=cfg.model_code == "trust")


def _resolve_model(cfg: ScoreConfig) -> _Model:
    """cfg.model as the job's one model: a registered model is resolved once, here, so the whole
    job scores with that one version."""
    from training import load_model

    if not is_registry_uri(cfg.model):
        return _Model(cfg.model, None, _model_marker(cfg.model))
    registered = resolve_registry_model(cfg.model)
    model_uri, registry_uri = registered.pinned_uri, registered.registry_uri
    if registered.location is not None:  # its artifacts on a file system: the marker, as for a path
        model = _Model(model_uri, registry_uri, _model_marker(registered.location), registered)
    else:  # downloaded once, here, for its identity
        loaded = load_model(model_uri, program=cfg.program, registry_uri=registry_uri,
                            trust_code=cfg.model_code == "trust")
        model = _Model(model_uri, registry_uri, {"model_json_sha256": loaded.fingerprint}, registered, loaded)
    log.info("%s is version %s of %s in %s", cfg.model, registered.version, registered.name, registry_uri)
    return model


def _output_mode(session: _SessionWhenNeeded, cfg: ScoreConfig, out, model: _Model, input_record: dict,
                 input_fp: str) -> str:
    """output.mode as this run applies it: ``skip_if_exists`` becomes ``overwrite`` where the
    alias the model was named by has moved since the scores were written, or where output.table
    (checked here, against the mode) does not hold the scores the path records."""
    mode = cfg.output.mode
    registered = model.registered
    if registered is not None and registered.alias and mode == "skip_if_exists" and _alias_moved(out, cfg, input_record,
                                                                                                   input_fp):
        log.info("%s holds scores of another version than %s now names (version %s): the alias moved, so the input "
                 "is scored again and the scores replaced", out.uri, cfg.model, registered.version)
        mode = "overwrite"
    if cfg.output.table is not None:
        mode = _check_table(session(), cfg, out, input_fp, mode)
    return mode


@dataclass
class _Scoring:
    """The input as the scoring pass reads it: ``checked`` is ``table`` with each row's quarantine
    reason; ``spec`` the model's features, which ``encoded`` (a dataset's split) holds encoded."""

    table: object
    malformed: list  # the sources' malformed-record frames, quarantined beside the bad rows
    bad_records: int  # their rows
    fields: dict
    spec: object
    encoded: bool
    checked: object


def _checked_input(spark, cfg: ScoreConfig, spec) -> _Scoring:
    from common.spark import spark_errors

    encoded = cfg.dataset is not None
    table, malformed = _dataset_table(spark, cfg, spec) if encoded else _sources_table(spark, cfg)
    fields = {f.name: f.dataType for f in table.schema.fields}
    _check_columns(fields, cfg)
    # Before any SQL is built from the features: a missing or uncastable one is the user's to fix
    # (exit 2, naming it), not an analysis error of the quarantine's SQL.
    check_feature_types(fields, spec, encoded)
    reason = reason_sql(fields, spec, encoded)
    checked = table if encoded else prepared_frame(table, spec)  # an image's one decode to check it
    checked = checked.selectExpr("*", f"{reason} AS {REASON}")
    with spark_errors("counting malformed records"):
        bad_records = sum(frame.count() for frame in malformed)
    return _Scoring(table, malformed, bad_records, fields, spec, encoded, checked)


@dataclass
class _Counted:
    """What the scoring pass counted: rows per quarantine reason, clean rows, each feature's null share."""

    by_reason: dict[str, int]
    clean_rows: int
    null_share: dict

    @property
    def quarantined(self) -> int:
        return sum(self.by_reason.values())

    @property
    def input_rows(self) -> int:
        return self.clean_rows + self.quarantined


def _score_into(staging, spark, cfg: ScoreConfig, out, model: _Model, scoring: _Scoring, identity: dict) -> _Counted:
    """Inside the output's staging directory: score the clean rows and write them (to the path, or
    to a staging table), in the one pass that also counts every row by reason and each feature's
    nulls; then refuse an empty or too-null input, write the quarantine, check the accounting, write
    ``_scores.json`` and the config, and swap a staging table in. ``identity``: the input's
    fingerprint and record."""
    from common.spark import spark_errors

    # The scoring pass counts every row by reason as it reads them (an observation: no pass of its own).
    reasons = reason_values(scoring.fields, scoring.spec, scoring.encoded)
    observed, counting = _observe_reasons(scoring.checked, reasons)
    # The same pass counts each feature's nulls.
    observed, null_counting = observe_nulls(observed, scoring.spec, scoring.encoded)
    scored = predict_frame(observed.where(f"{REASON} IS NULL"), model.uri, batch_size=cfg.batch_size,
                           temperature=cfg.temperature, keep_columns=cfg.output.keep_columns,
                           encoded=scoring.encoded, program=cfg.program, registry_uri=model.registry_uri,
                           fingerprint=model.sha256, trust_code=cfg.model_code == "trust").drop(REASON)
    staged_table = None
    try:
        staged_table = _write_scores(scored, staging, cfg, out, identity["input_fingerprint"])
        counted = _counted(cfg, scoring, counting, reasons, null_counting)
        _write_quarantine(staging, cfg, out, scoring, counted)
        table_rows = None if staged_table is None else spark.table(staged_table).count()
        accounting = _check_accounting(staging, counted.input_rows, counted.clean_rows, counted.quarantined, table_rows)
        summary = _scores_summary(cfg, model, identity, scored.columns, accounting, counted)
        staging.write_text(SUMMARY_NAME, json.dumps(summary, indent=2, default=str) + "\n")
        staging.write_text(CONFIG_NAME, dump_yaml(cfg))
        if staged_table is not None:
            with spark_errors(f"publishing the scores as table {cfg.output.table}"):
                swap_in(spark, staged_table, cfg.output.table, "output.table")
            staged_table = None
    finally:
        if staged_table is not None:  # a check failed: the staging table goes with the staging directory
            spark.sql(f"DROP TABLE IF EXISTS {quote_table(staged_table)}")
    return counted


def _write_scores(scored, staging, cfg: ScoreConfig, out, input_fp: str) -> str | None:
    """The scores written to the staging directory, or to a staging table (its name returned)."""
    from common.spark import spark_errors

    target = out.uri if cfg.output.table is None else f"table {cfg.output.table}"
    # The output first: what fails here is mostly the write (a full disk), seldom the model.
    with spark_errors(f"writing the scores to {target} (model {cfg.model})"):
        if cfg.output.table is None:
            _write(scored, staging.uri)
            return None
        return write_staging_table(scored, cfg.output.table,
                                   {KIND_PROPERTY: KIND_SCORES, FINGERPRINT_PROPERTY: input_fp})


def _counted(cfg: ScoreConfig, scoring: _Scoring, counting, reasons: list[str], null_counting) -> _Counted:
    """The scoring pass's counts, once it has run: an input with no rows is refused, and so is one
    whose features' nulls grew past ``quality.fail_null_increase`` (nothing is published)."""
    by_reason, clean_rows = _counts(counting, reasons, scoring.bad_records)
    if clean_rows + sum(by_reason.values()) == 0:
        raise InputDataError(f"the input has no rows ({_describe_input(cfg)})")  # nothing is published
    null_share = compare_null_shares(scoring.spec, null_counting, cfg.quality)  # may refuse: nothing is published
    return _Counted(by_reason, clean_rows, null_share)


def _write_quarantine(staging, cfg: ScoreConfig, out, scoring: _Scoring, counted: _Counted) -> None:
    from common.spark import spark_errors

    quarantine = _quarantine_rows(cfg, scoring.checked, scoring.table.columns, scoring.malformed, scoring.spec)
    if not counted.by_reason:  # nothing to find in another pass over the input: the same empty file, from no rows
        quarantine = quarantine.limit(0)
    with spark_errors(f"writing the quarantine to {out.uri}/{QUARANTINE_DIR}"):
        _write(quarantine, staging.join(QUARANTINE_DIR).uri)


def _scores_summary(cfg: ScoreConfig, model: _Model, identity: dict, columns: list[str], accounting: dict,
                    counted: _Counted) -> dict:
    """``_scores.json``: the model, the input, the columns, the accounting, the quarantine, the null shares."""
    return {"format": KIND_SCORES, "shardtrain_version": __version__, "model": cfg.model,
            "model_json_sha256": model.sha256, **model.version_record(), **identity, "columns": columns,
            **({"table": cfg.output.table} if cfg.output.table else {}), "accounting": accounting,
            "quarantine": {"path": QUARANTINE_DIR, "by_reason": dict(sorted(counted.by_reason.items()))},
            "null_share": counted.null_share, "config": to_dict(cfg)}


def _model_marker(uri: str) -> dict:
    """The model's marker (kind checked; its model.json digest goes into the input fingerprint)."""
    from common.commit_marker import KIND_MODEL
    from common.errors import StorageError

    try:
        marker = read_marker(uri)
    except StorageError as exc:
        raise DatasetError(f"model {first_line(exc)} (model)") from None
    if marker.get("kind", marker.get("format")) != KIND_MODEL:
        raise DatasetError(f"model {uri} holds a {marker.get('kind') or 'output of another kind'}, not a {KIND_MODEL} "
                           "(model)")
    return marker


def _input_record(cfg: ScoreConfig, spark=None) -> dict:
    """What the input is, for the fingerprint, without Spark work: the source files (paths, sizes,
    modification times; a table's from its catalog, ``common.sources``), or the dataset's content
    fingerprint and the split."""
    if cfg.dataset is not None:
        from common.dataset import read_manifest

        manifest = read_manifest(cfg.dataset)
        return {"dataset": manifest.root.uri, "fingerprint": manifest.fingerprint, "split": cfg.split}
    from common.sources import source_fingerprint

    return {"sources": {name: source_fingerprint(name, src, spark) for name, src in cfg.sources.items()}}


def _sources_table(spark, cfg: ScoreConfig):
    """(the query's table, the sources' malformed-record frames)."""
    from common.sources import read_sources

    frames = read_sources(spark, cfg.sources)
    for frame in frames.values():
        frame.persist()  # the table and the malformed records each read the parse
    if cfg.query is not None:
        try:
            table = spark.sql(cfg.query)
        except Exception as exc:  # noqa: BLE001 - AnalysisException / ParseException
            raise InputDataError(f"query failed to analyse over sources {sorted(frames)}: {first_line(exc)}") from None
    else:
        (frame,) = frames.values()
        table = frame.clean
    return table, [f.malformed for f in frames.values() if f.malformed is not None]


def _dataset_table(spark, cfg: ScoreConfig, spec):
    """(the split's stored rows, no malformed frames), after checking they are encoded the way the
    model was trained and that every file matches its manifest sha256."""
    from common.dataset import read_manifest
    from common.dataset_files import verify_file
    from common.spark import to_spark_path

    manifest = read_manifest(cfg.dataset)
    if manifest.features.encoding != spec.encoding:
        raise DatasetError(
            f"dataset {manifest.root.uri} encodes its features differently from the model {cfg.model} (other "
            "statistics or vocabularies: the model was trained on another dataset). Its stored rows would mean "
            "something else to the model: score the raw data through sources instead (dataset, sources)")
    entries = manifest.files(cfg.split)
    for entry in entries:
        verify_file(manifest.root, entry)
    paths = [to_spark_path(manifest.root.join(e.path).uri) for e in entries]
    return spark.read.parquet(*paths), []


def input_fingerprint(cfg: ScoreConfig, input_record: dict, model_marker: dict) -> str:
    """What the output is a function of: the config (minus how it runs), the input, the model."""
    config = to_dict(cfg)
    config.pop("spark", None)
    config.pop("quality", None)  # it decides whether the scores are published, not what they are
    config["output"].pop("mode", None)
    payload = {"config": config, "input": input_record, "model_json_sha256": model_marker.get("model_json_sha256"),
               "shardtrain_version": __version__}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


_SCORES = OutputWords(kind=KIND_SCORES, identical="identical scores", committed="committed scores",
                      other="other scores", inputs="the config, the input files or the model", plural=True)


def _alias_moved(out, cfg: ScoreConfig, input_record: dict, input_fp: str) -> bool:
    """Whether ``out`` holds scores of this very config and input by another model: what a
    ``models:/NAME@ALIAS`` gives once the alias has moved (the marker records the model.json
    sha256 the scores were computed with, so the fingerprint they had can be recomputed)."""
    if not is_committed(out):
        return False
    marker = read_marker(out)
    before = marker.get("model_json_sha256")
    if marker.get("kind") != KIND_SCORES or not before or marker.get("input_fingerprint") == input_fp:
        return False
    return input_fingerprint(cfg, input_record, {"model_json_sha256": before}) == marker.get("input_fingerprint")


def _check_table(spark, cfg: ScoreConfig, out, input_fp: str, mode: str) -> str:
    """output.table against the mode (under the writer lock, after putting back what a killed
    publish left): ``error`` refuses an existing table, the other modes replace only a scores table
    a score job wrote; the mode to go on with (``skip_if_exists`` becomes ``overwrite`` where the
    path holds this input's scores but the table does not)."""
    name = cfg.output.table
    clean_stale_tables(spark, name)
    path_holds_these = is_committed(out) and read_marker(out).get("input_fingerprint") == input_fp
    if not table_exists(spark, name):
        if mode == "skip_if_exists" and path_holds_these:
            log.info("output.table %s is gone, while %s records its scores; scoring again", name, out.uri)
            return "overwrite"
        return mode
    if mode == "error":
        raise OutputExistsError(f"output.table {name} already exists; set output.mode=overwrite to replace it "
                                "(or skip_if_exists to keep identical scores)")
    props = table_properties(spark, name)
    if props.get(KIND_PROPERTY) != KIND_SCORES:
        raise ConfigError(f"output.table {name} exists and was not written by a score job (no {KIND_PROPERTY}="
                          f"{KIND_SCORES} property); shardtrain replaces only its own scores tables: drop it or choose "
                          "another output.table")
    if mode == "skip_if_exists" and props.get(FINGERPRINT_PROPERTY) != input_fp and path_holds_these:
        log.info("output.table %s does not hold the scores %s records; scoring again", name, out.uri)
        return "overwrite"
    return mode


def _check_existing(out, cfg: ScoreConfig, input_fp: str, mode: str) -> ScoreResult | None:
    """The scores already at the output when skip_if_exists finds these; None to go on."""
    if existing_output(out, mode, _SCORES, input_fp) != SAME:
        return None
    summary = json.loads(out.read_text(SUMMARY_NAME))
    acc = summary["accounting"]
    return ScoreResult(uri=out.uri, input_rows=acc["input_rows"], scored_rows=acc["scored_rows"],
                       quarantined_rows=acc["quarantined_rows"], by_reason=summary["quarantine"]["by_reason"],
                       skipped=True, table=cfg.output.table)


def _check_columns(fields: dict, cfg: ScoreConfig) -> None:
    missing = [c for c in cfg.output.keep_columns if c not in fields]
    if missing:
        raise InputDataError(f"output.keep_columns names column(s) {missing} that {_describe_input(cfg)} does not "
                             f"have; it has {sorted(fields)}")
    if REASON in fields:
        raise InputDataError(f"the input has a column named {REASON!r}, which the score job adds; rename it in the query")


def _observe_reasons(checked, reasons: list[str]):
    """(``checked`` counting its rows per reason as any action reads it, the observation). Every
    reason ``reason_sql`` can give is counted by name (``reasons``, read off its own branches); all
    rows and the clean ones are counted too, so a reason missing from the list shows. The caller
    filters the clean rows above the observation (Spark does not push a filter below one)."""
    from pyspark.sql import Observation
    from pyspark.sql import functions as F

    counting = Observation("score_reasons")
    metrics = [F.count(F.lit(1)).alias("rows"), F.count_if(F.col(REASON).isNull()).alias("clean")]
    metrics += [F.count_if(F.col(REASON) == F.lit(r)).alias(f"reason_{i}") for i, r in enumerate(reasons)]
    return checked.observe(counting, *metrics), counting


def _counts(counting, reasons: list[str], bad_records: int) -> tuple[dict[str, int], int]:
    """Rows per quarantine reason (only reasons that occur), and clean rows, from the observation
    of the scoring pass (plus the malformed records of the sources)."""
    got = counting.get
    by_reason = {r: int(got[f"reason_{i}"]) for i, r in enumerate(reasons) if got[f"reason_{i}"]}
    unnamed = int(got["rows"]) - int(got["clean"]) - sum(by_reason.values())
    if unnamed:  # reason_values missed a rule: the accounting would not balance, so say why here
        raise AccountingError(f"{unnamed} quarantined rows have a reason outside {reasons}")
    if bad_records:
        by_reason["malformed_record"] = bad_records
    return by_reason, int(got["clean"])


def _quarantine_rows(cfg: ScoreConfig, checked, columns: list[str], malformed: list, spec=None):
    from pyspark.sql import functions as F

    source = "dataset" if cfg.dataset is not None else ("query" if cfg.query is not None else next(iter(cfg.sources)))
    bad = checked.where(f"{REASON} IS NOT NULL").select(
        F.col(REASON).alias("reason"), F.lit(source).alias("source"), F.expr(raw_json_sql(columns, spec)).alias("raw"))
    for frame in malformed:
        bad = bad.unionByName(frame)
    return bad


def _write(frame, uri: str) -> None:
    from common.spark import to_spark_path

    frame.write.mode("overwrite").parquet(to_spark_path(uri))


def _check_accounting(staging, input_rows: int, clean_rows: int, quarantined_rows: int,
                      table_rows: int | None = None) -> dict:
    """Rows in the written files (their Parquet footers; the staging table's count where the scores
    go to a table), against the counts: nothing published otherwise."""
    scored = table_rows if table_rows is not None else \
        _rows_written(staging, lambda rel: not rel.startswith(QUARANTINE_DIR + "/"))
    quarantined = _rows_written(staging, lambda rel: rel.startswith(QUARANTINE_DIR + "/"))
    record = {"input_rows": input_rows, "scored_rows": scored, "quarantined_rows": quarantined}
    if scored != clean_rows or scored + quarantined != input_rows or quarantined != quarantined_rows:
        raise AccountingError(
            f"row accounting does not balance: input {input_rows} != scored {scored} + quarantined {quarantined} "
            f"(counted {clean_rows} clean and {quarantined_rows} bad rows earlier). The input changed while the job "
            "ran, or the query is not deterministic; nothing was published")
    return record


def _rows_written(staging, wanted) -> int:
    import pyarrow.parquet as pq

    fs = staging.fs
    total = 0
    for path in fs.find(staging.path):
        rel = posixpath.relpath(path, staging.path)
        name = posixpath.basename(rel)
        if not name.endswith(".parquet") or name.startswith((".", "_")) or not wanted(rel):
            continue
        with fs.open(path, "rb") as fh:
            total += pq.ParquetFile(fh).metadata.num_rows
    return total


def _describe_input(cfg: ScoreConfig) -> str:
    if cfg.dataset is not None:
        return f"split {cfg.split!r} of dataset {cfg.dataset}"
    return "the query's table" if cfg.query is not None else f"source {next(iter(cfg.sources))!r}"


# --- command handler (shardtrain score) -----------------------------------------------------------

def score(config, overrides=None, spark=None) -> ScoreResult:
    """Run the score job. ``config``: a ScoreConfig or a YAML path (plus ``key=value`` overrides)."""
    from common.storage import check_uri
    from scoring.config import load_score_config

    cfg = config if isinstance(config, ScoreConfig) else load_score_config(config, list(overrides or []))
    for uri in [cfg.output.path, *cfg.inputs.values()]:
        check_uri(uri)  # a bad URI or missing credentials fails before Spark starts
    check_output_path(cfg)
    return run_score_job(spark, cfg)  # Spark starts once the job needs it


def handle_score(args) -> int:
    print(score(args.config, args.overrides).summary())
    return 0


__all__ = ["ScoreResult", "check_output_path", "handle_score", "input_fingerprint", "run_score_job", "score"]
