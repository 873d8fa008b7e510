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

A source is a ``path`` (files: ``format`` csv, json, parquet, binaryFile: one row per file with its
bytes, e.g. a folder of images, or delta: a Delta table's directory, read by Spark's Delta reader) or a ``table`` the session's catalog resolves (``catalog.schema.table``;
its format is the catalog's). Exactly one of the two.

Source fingerprints say whether the input changed (``skip_if_exists``, the overlap checks): a
path's files (paths, sizes, modification times) listed with the storage module, not Spark, so
``skip_if_exists`` can decide without starting any Spark work; a Delta path, its newest commit in
``_delta_log``; a Delta table, its latest version (``DESCRIBE HISTORY``); another table, the files
at its location (as for a path). A table's are asked of the catalog, so they need the session.

Driver-only. It owns how a source is read and listed; what a job does with the views (its
query, its quarantine) is the job's own.
"""

from __future__ import annotations

import glob as globlib
import posixpath
import re
from dataclasses import dataclass
from typing import Any, Literal

from common.config import require, setting, storage_path
from common.errors import ConfigError, InputDataError, ShardtrainError, first_line
from common.sql import quote_identifier as q
from common.sql import why_not_a_query
from common.storage import resolve, storage_errors
from common.tables import (check_delta_reader_error, table_parts, delta_log_version, delta_table_bytes, delta_table_version,
                           describe_table)

CORRUPT_COLUMN = "_corrupt_record"
MALFORMED = "malformed_record"


@dataclass
class SourceConfig:
    path: str | None = storage_path(
        "URI of a file or directory (or a Delta table's directory, with `format: delta`); the source becomes "
        "a Spark SQL view of its name. Exactly one of `path` and `table`", default=None)
    # A Delta path is read by Spark's Delta reader, which delta-spark or a Databricks runtime provides.
    format: Literal["csv", "json", "parquet", "delta", "binaryFile"] = setting(
        "the files' format; `delta` reads a Delta table's directory (without a Delta reader in the session: "
        "exit 2 with the install hint); `binaryFile` reads each file as one row (`path`, `modificationTime`, "
        "`length`, `content`: its bytes, e.g. an image), with the options `pathGlobFilter` and "
        "`recursiveFileLookup`. A table's format is its catalog's", default="parquet")
    options: dict[str, Any] = setting("Spark reader options (`header: true`, `sep: \";\"`, ...)",
                                      default_factory=dict)
    schema: str | None = setting(
        "Spark DDL (`id BIGINT, x DOUBLE, city STRING`); advised for CSV and JSON: with it, a value that does "
        "not parse quarantines its record as `malformed_record`", default=None)
    table: str | None = setting(
        "instead of `path`: a table the session's catalog resolves, `table`, `schema.table` or "
        "`catalog.schema.table` (a local in-memory or Hive catalog, Unity Catalog on Databricks); its format "
        "and schema are the catalog's", default=None)

    def __post_init__(self):
        require((self.path is None) != (self.table is None), "path",
                "or table must be set (exactly one): files at a path, or a catalog table")
        if self.path is not None:
            require(bool(self.path), "path", "must not be empty")
            require(self.format not in ("delta", "binaryFile") or self.schema is None, "schema",
                    f"applies to csv, json and parquet paths; {self.format} has its own schema")
        else:
            table_parts(self.table, "table")
            require(self.format in ("parquet", "delta"), "format",
                    f"applies to a path; a table's format is its catalog's (got format={self.format} with table); "
                    "remove format")
            require(self.schema is None, "schema", "applies to a path; a table has its own schema (remove schema)")

    @property
    def key(self) -> str:
        """The config key naming where this source is (for messages): ``path`` or ``table``."""
        return "table" if self.table is not None else "path"

    @property
    def location(self) -> str:
        """The path, or the table's name (for messages)."""
        return self.table if self.table is not None else self.path


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


def source_fingerprint(name: str, cfg: SourceConfig, spark=None) -> dict:
    """What the source's data is, to tell whether it changed (see the module docstring): for files,
    each with its size and modification time, sorted by path. A table needs ``spark`` (its catalog)."""
    if cfg.table is not None:
        if spark is None:
            raise TypeError("a table source's fingerprint needs the Spark session")
        return _table_fingerprint(name, cfg, spark)
    if cfg.format == "delta":
        return {"path": cfg.path, "format": "delta", **_delta_log_fingerprint(name, cfg),
                "files": _file_entries(name, cfg.path, _data_files(name, cfg), "path")}
    entries = _file_entries(name, cfg.path, _data_files(name, cfg), "path")
    if not entries:
        raise InputDataError(f"source {name!r}: {cfg.path} holds no data files (sources.{name}.path)")
    if cfg.format == "parquet":
        _check_parquet_sizes(name, entries)
    return {"path": cfg.path, "format": cfg.format, "files": entries}


# A Parquet file is at least its magic, a 4-byte footer length and its magic again.
_PARQUET_MIN_BYTES = 12


def _check_parquet_sizes(name: str, entries: list[dict]) -> None:
    """A file too short to be Parquet (an empty file a failed upload left, say) is named here, from
    the listing, before Spark reads footers on its executors and fails in a page of JVM stack."""
    short = [e for e in entries if e["size"] < _PARQUET_MIN_BYTES]
    if short:
        listed = ", ".join(f"{e['path']} ({e['size']} bytes)" for e in short[:3]) + (" ..." if len(short) > 3 else "")
        raise InputDataError(f"source {name!r}: {len(short)} file(s) too short to be Parquet: {listed}; remove them or "
                             f"point sources.{name}.path at the data files only")


def source_bytes(fingerprint: dict) -> int | None:
    """The source's size in bytes from its fingerprint (None where it says nothing: a Delta table
    whose runtime does not tell)."""
    if "files" in fingerprint:
        return sum(f["size"] for f in fingerprint["files"])
    return fingerprint.get("bytes")


def _file_entries(name: str, where: str, files: list[str], key: str) -> list[dict]:
    fs = resolve(where).fs
    entries = []
    for path in files:
        with storage_errors(f"reading the size and time of source {name!r}'s file (sources.{name}.{key})", path):
            info = fs.info(path)
        mtime = info.get("mtime", info.get("LastModified", info.get("last_modified")))
        entries.append({"path": path, "size": int(info.get("size") or 0),
                        "mtime": mtime.isoformat() if hasattr(mtime, "isoformat") else mtime})
    return entries


def _delta_log_fingerprint(name: str, cfg: SourceConfig) -> dict:
    """A Delta path's newest commit (version, and its file's size and time: a table deleted and
    created again at the path starts its versions over)."""
    loc = resolve(cfg.path)
    log_dir = posixpath.join(loc.path, "_delta_log")
    with storage_errors(f"listing source {name!r}'s Delta log (sources.{name}.path)", cfg.path):
        names = [posixpath.basename(p) for p in loc.fs.ls(log_dir, detail=False)] if loc.fs.isdir(log_dir) else []
    version = delta_log_version(names)
    if version is None:
        raise InputDataError(f"source {name!r}: {cfg.path} has no Delta log (_delta_log/*.json), so it is not a Delta "
                             f"table (sources.{name}.format=delta); set the format of its files instead")
    commit = _file_entries(name, cfg.path, [posixpath.join(log_dir, f"{version:020d}.json")], "path")[0]
    return {"version": version, "commit": {"size": commit["size"], "mtime": commit["mtime"]}}


def _table_fingerprint(name: str, cfg: SourceConfig, spark) -> dict:
    key = f"sources.{name}.table"
    info = describe_table(spark, cfg.table, key)
    record = {"table": cfg.table, "format": info.provider, "location": info.location}
    if info.provider == "delta":
        return {**record, "version": delta_table_version(spark, cfg.table, key),
                "bytes": delta_table_bytes(spark, cfg.table)}
    if not info.location:
        raise InputDataError(f"source {name!r}: {cfg.table} has no storage location (a view?), so shardtrain cannot "
                             f"tell when it changes ({key}); read the tables it selects from, or save it as a table")
    try:
        files = _listed_files(name, info.location, key)
    except ShardtrainError as exc:
        raise InputDataError(f"source {name!r}: cannot list the files of table {cfg.table} at {info.location} "
                             f"({first_line(exc)}); {key}") from None
    return {**record, "files": _file_entries(name, info.location, files, "table")}


def check_table_inputs(output_uri: str, output_key: str, sources_fp: dict) -> None:
    """An output may not be, contain or sit inside a table source's location (exit 2): the
    path sources are checked before any work, a table's location is known from its fingerprint."""
    from common.output_guard import check_disjoint

    locations = {f"source {name!r} (sources.{name}.table {fp['table']})": fp.get("location")
                 for name, fp in sources_fp.items() if "table" in fp and fp.get("location")}
    for what, location in locations.items():
        try:
            resolve(location)
        except ShardtrainError:
            continue  # a scheme the storage module has no file system for: no output path can be there
        check_disjoint(output_uri, output_key, {what: location})


def _data_files(name: str, cfg: SourceConfig) -> list[str]:
    """The source's data files (file system paths), sorted, as Spark would read them (a
    ``pathGlobFilter`` option keeps the files whose name matches it, as Spark's filter does)."""
    files = _listed_files(name, cfg.path, f"sources.{name}.path")
    pattern = {k.lower(): v for k, v in cfg.options.items()}.get("pathglobfilter")
    if pattern is not None:
        matches = glob_filter(str(pattern))
        files = [f for f in files if matches(posixpath.basename(f))]
    return files


def glob_filter(pattern: str):
    """A file name test for Spark's ``pathGlobFilter`` (Hadoop's GlobPattern: ``*``, ``?``,
    ``[abc]``, ``[^abc]``, ``{a,b}``, ``\\`` escapes), so the listing fingerprints exactly the files
    Spark reads."""
    out, depth, i = [], 0, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            out.append(re.escape(pattern[i + 1]))
            i += 1
        elif c == "*":
            out.append(".*")
        elif c == "?":
            out.append(".")
        elif c == "[":
            end = pattern.find("]", i + 1)
            if end < 0:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1:end]
                out.append("[" + ("^" + body[1:] if body[:1] in ("^", "!") else body) + "]")
                i = end
        elif c == "{":
            depth += 1
            out.append("(?:")
        elif c == "}" and depth:
            depth -= 1
            out.append(")")
        elif c == "," and depth:
            out.append("|")
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out) + r"\Z", re.DOTALL).match


def _listed_files(name: str, where: str, key: str) -> list[str]:
    """The data files at ``where`` (a path, maybe a glob), sorted, as Spark would read them."""
    loc = resolve(where)
    fs = loc.fs
    with storage_errors(f"listing source {name!r} ({key})", where):
        paths = fs.glob(loc.path) if globlib.has_magic(loc.path) else ([loc.path] if fs.exists(loc.path) else [])
    if not paths:
        raise InputDataError(f"source {name!r}: path {where} does not exist ({key})")
    files = []
    for top in sorted(paths):
        with storage_errors(f"listing source {name!r} ({key})", top):
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

    options = {k: (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in cfg.options.items()}
    if cfg.table is not None:
        with _delta_reader(name, cfg), spark_errors(f"reading source {name!r} (table {cfg.table})"):
            df = spark.read.options(**options).table(cfg.table)
        return SourceFrames(name, cfg, df, None)
    path = to_spark_path(cfg.path)
    what = f"reading source {name!r} ({cfg.format} at {cfg.path})"
    if cfg.format == "delta":
        with _delta_reader(name, cfg), _input_errors(name, cfg), spark_errors(what):
            df = spark.read.format("delta").options(**options).load(path)
        return SourceFrames(name, cfg, df, None)
    if cfg.format == "binaryFile":
        with _input_errors(name, cfg), spark_errors(what):
            df = spark.read.format("binaryFile").options(**options).load(path)
        return SourceFrames(name, cfg, df, None)
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


class _delta_reader:
    """Spark's "no data source delta" as exit 2 naming the source's key, with the install hint."""

    def __init__(self, name: str, cfg: SourceConfig):
        self.key = f"sources.{name}.{cfg.key}"

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is not None:
            check_delta_reader_error(exc, self.key)
        return False


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
           "check_table_inputs",
           "read_source", "read_sources", "source_bytes", "source_fingerprint"]
