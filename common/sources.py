"""The ``sources`` config section and reading it: one Spark view per source, malformed records
split off. The shard job and the score job read raw data the same way (same syntax, same
quarantine of records that do not parse), so both import it from here.

For CSV and JSON the reader runs in PERMISSIVE mode with a corrupt-record column (added to the
declared schema, or to the inferred one), so a record that does not parse is kept with its raw
text instead of failing the job or vanishing. Each source yields ``clean`` (the view the query
sees) and ``malformed`` (reason/source/raw rows for the quarantine). Both come from one parse of
the text (``parsed``); a caller that reads both calls ``SourceFrames.persist`` first, so each file
is parsed once, not once per pass, and ``release`` afterwards. Nothing is persisted unless asked:
Spark substitutes a persisted plan wherever the same plan is read, so a persisted parse would be
built (and cost more than the parse: 2M CSV rows, 13.2-13.8 s instead of 10.6 s for the shard
job's first pass, benchmarks/RESULTS.md) even for a caller that reads ``parsed`` once, as the shard
job does when its table is one source's rows as they are.

Source fingerprints (file paths, sizes, modification times) are listed with the storage module,
not Spark, so ``skip_if_exists`` can decide without starting any Spark work.

Driver-only. It owns how a source is read and listed; what a job does with the views (its
query, its quarantine) is the job's own.
"""

from __future__ import annotations

import glob as globlib
import posixpath
from dataclasses import dataclass, field
from typing import Any, Literal

from common.config import require
from common.errors import ConfigError, InputDataError, first_line
from common.sql import quote_identifier as q
from common.sql import why_not_a_query
from common.storage import resolve, storage_errors

CORRUPT_COLUMN = "_corrupt_record"
MALFORMED = "malformed_record"


@dataclass
class SourceConfig:
    path: str
    format: Literal["csv", "json", "parquet"] = "parquet"
    options: dict[str, Any] = field(default_factory=dict)
    # Spark DDL, e.g. "id BIGINT, x DOUBLE, city STRING". Strongly advised for CSV/JSON:
    # with a schema, a value that does not parse makes its record malformed (quarantined).
    schema: str | None = None

    def __post_init__(self):
        require(bool(self.path), "path", "must not be empty")


def check_sources_and_query(sources: dict[str, SourceConfig], query: str | None) -> None:
    """For a config's ``__post_init__``: every source is a valid view name, and ``query`` (required
    with several sources) is one query that only reads. The shard and score jobs give them one
    meaning, so one check."""
    for name in sources:
        require(name.isidentifier(), f"sources.{name}", "must be a valid SQL view name (letters, digits, _)")
    require(query is not None or len(sources) == 1, "query", "is required when there is more than one source")
    not_a_query = why_not_a_query(query) if query is not None else None
    require(not_a_query is None, "query", f"must be a single SELECT query: it {not_a_query}")


@dataclass
class SourceFrames:
    name: str
    config: SourceConfig
    clean: object  # DataFrame: the source's columns, malformed records removed
    malformed: object | None  # DataFrame(reason, source, raw), or None for Parquet
    parsed: object | None = None  # the parse clean and malformed read (CSV/JSON), with the corrupt-record column
    persisted: bool = False

    def persist(self) -> None:
        """Keep the parse (memory, then disk) for a caller that reads both ``clean`` and
        ``malformed``; built by the first pass that reads it (lazy)."""
        from pyspark import StorageLevel

        if self.parsed is not None and not self.persisted:
            self.parsed.persist(StorageLevel.MEMORY_AND_DISK)
            self.persisted = True

    def release(self) -> None:
        """Drop the persisted parse (the job calls this once every pass over the source is done)."""
        if self.persisted:
            self.parsed.unpersist()
            self.persisted = False


def source_fingerprint(name: str, cfg: SourceConfig) -> dict:
    """Every data file of the source with its size and modification time, sorted by path."""
    fs = resolve(cfg.path).fs
    files = _data_files(name, cfg)
    entries = []
    for path in files:
        with storage_errors(f"reading the size and time of source {name!r}'s file", path):
            info = fs.info(path)
        mtime = info.get("mtime", info.get("LastModified", info.get("last_modified")))
        entries.append({"path": path, "size": int(info.get("size") or 0),
                        "mtime": mtime.isoformat() if hasattr(mtime, "isoformat") else mtime})
    if not entries:
        raise InputDataError(f"source {name!r}: {cfg.path} holds no data files (sources.{name}.path)")
    return {"path": cfg.path, "format": cfg.format, "files": entries}


def _data_files(name: str, cfg: SourceConfig) -> list[str]:
    """The source's data files (file system paths), sorted, as Spark would read them."""
    loc = resolve(cfg.path)
    fs = loc.fs
    with storage_errors(f"listing source {name!r} (sources.{name}.path)", cfg.path):
        paths = fs.glob(loc.path) if globlib.has_magic(loc.path) else ([loc.path] if fs.exists(loc.path) else [])
    if not paths:
        raise InputDataError(f"source {name!r}: path {cfg.path} does not exist (sources.{name}.path)")
    files = []
    for top in sorted(paths):
        with storage_errors(f"listing source {name!r} (sources.{name}.path)", top):
            # on_error: fsspec would otherwise skip an unreadable subdirectory, and its files, in silence.
            listed = sorted(fs.find(top, on_error="raise")) if fs.isdir(top) else None
        if listed is not None:
            for path in listed:
                rel = posixpath.relpath(path, top)
                # Spark skips files and directories whose names start with _ or . (markers, staging).
                if any(part.startswith(("_", ".")) for part in rel.split("/")):
                    continue
                files.append(path)
        else:
            files.append(top)
    return files


def check_csv_header(name: str, cfg: SourceConfig) -> None:
    """A CSV header that names a column twice is an error, with or without a schema: Spark
    renames duplicates (or, with a schema, ignores the header), so the job would silently read
    columns other than the ones the file names. Reads the first line of the first file only
    (Spark takes the column names from one file, too)."""
    import csv
    import io

    options = {k.lower(): v for k, v in cfg.options.items()}
    if cfg.format != "csv" or str(options.get("header", "false")).lower() != "true":
        return
    files = _data_files(name, cfg)
    if not files:
        return
    fs = resolve(cfg.path).fs
    with storage_errors(f"reading the CSV header of source {name!r}", files[0]), \
            fs.open(files[0], "rb", compression="infer") as fh:
        first = fh.readline(1 << 20)
    encoding = str(options.get("encoding", options.get("charset", "utf-8")))
    line = first.decode(encoding, errors="replace").rstrip("\r\n")
    sep = str(options.get("sep", options.get("delimiter", ",")))
    quote = str(options.get("quote", '"')) or '"'
    header = next(csv.reader(io.StringIO(line), delimiter=sep[:1] or ",", quotechar=quote[:1]), [])
    seen: dict[str, str] = {}
    dups = []
    for column in header:
        key = column.strip().lower()  # Spark compares column names case-insensitively by default
        if key in seen and column not in dups:
            dups.append(column)
        seen.setdefault(key, column)
    if dups:
        raise InputDataError(f"source {name!r}: the CSV header of {files[0]} names column(s) {dups} more than once; "
                             f"give every column a distinct name in the file (sources.{name}.path)")


def read_source(spark, name: str, cfg: SourceConfig) -> SourceFrames:
    from pyspark.sql import functions as F

    from common.spark import spark_errors, to_spark_path

    path = to_spark_path(cfg.path)
    options = {k: (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in cfg.options.items()}
    what = f"reading source {name!r} ({cfg.format} at {cfg.path})"
    if cfg.format == "parquet":
        with _input_errors(name, cfg), spark_errors(what):
            reader = spark.read.options(**options)
            if cfg.schema:
                reader = reader.schema(cfg.schema)
            df = reader.parquet(path)
        return SourceFrames(name, cfg, df, None)

    check_csv_header(name, cfg)
    options = {**options, "mode": "PERMISSIVE", "columnNameOfCorruptRecord": CORRUPT_COLUMN}
    with _input_errors(name, cfg), spark_errors(what):
        if cfg.schema:
            schema = _parse_ddl(spark, name, cfg.schema)
        else:
            schema = spark.read.format(cfg.format).options(**options).load(path).schema  # infers (one pass)
        if CORRUPT_COLUMN not in schema.fieldNames():
            from pyspark.sql.types import StringType, StructField, StructType

            schema = StructType([*schema.fields, StructField(CORRUPT_COLUMN, StringType(), True)])
        raw = spark.read.format(cfg.format).options(**options).schema(schema).load(path)
    data_cols = [c for c in raw.columns if c != CORRUPT_COLUMN]
    # Reference every column in both filters: Spark parses only the columns a query uses, so a
    # bad value in a column nobody selects would otherwise be malformed in one plan and not in
    # the other (and Spark refuses queries that use only the corrupt-record column). pmod(...) >= 0
    # is always true, but the optimizer cannot prove it and so keeps every column.
    every_column = F.expr(f"pmod(xxhash64({', '.join(q(c) for c in raw.columns)}), 2) >= 0")
    is_bad = F.col(CORRUPT_COLUMN).isNotNull()
    clean = raw.filter(~is_bad & every_column).select(*[F.col(q(c)) for c in data_cols])
    malformed = raw.filter(is_bad & every_column).select(
        F.lit(MALFORMED).alias("reason"), F.lit(name).alias("source"), F.col(CORRUPT_COLUMN).alias("raw"))
    return SourceFrames(name, cfg, clean, malformed, raw)


def read_sources(spark, sources: dict[str, SourceConfig]) -> dict[str, SourceFrames]:
    """Every source read, its clean rows registered as the Spark SQL view named like the source."""
    frames = {}
    for name, source in sources.items():
        frames[name] = read_source(spark, name, source)
        frames[name].clean.createOrReplaceTempView(name)
    return frames


def _parse_ddl(spark, name: str, ddl: str):
    from common.spark import ddl_schema

    try:
        return ddl_schema(spark, ddl)
    except Exception as exc:  # noqa: BLE001 - a parse error in user text becomes a config error
        raise ConfigError(f"sources.{name}.schema is not valid Spark DDL ({first_line(exc)}): {ddl!r}") from None


class _input_errors:
    """Turn Spark's "path does not exist" into an InputDataError naming the source."""

    def __init__(self, name: str, cfg: SourceConfig):
        self.name, self.cfg = name, cfg

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is not None and "PATH_NOT_FOUND" in str(exc) or (exc is not None and "Path does not exist" in str(exc)):
            raise InputDataError(f"source {self.name!r}: path {self.cfg.path} does not exist "
                                 f"(sources.{self.name}.path)") from None
        return False


__all__ = ["CORRUPT_COLUMN", "MALFORMED", "SourceConfig", "SourceFrames", "check_csv_header", "check_sources_and_query",
           "read_source", "read_sources", "source_fingerprint"]
