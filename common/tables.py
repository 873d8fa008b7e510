"""Catalog tables as inputs and outputs: what a table is (format, location, version), asked of the
session's own catalog in SQL (a local in-memory or Hive catalog, Unity Catalog on Databricks; on
classic Spark or Spark Connect alike), whether Spark has a Delta reader, and publishing a table
atomically.

A table name is ``table``, ``schema.table`` or ``catalog.schema.table``, as the catalog resolves it.

Publishing (``publish_table``): the rows are written to a staging table beside the target
(``<name>__shardtrain_staging_<id>``, same catalog and schema), checked by the caller, then swapped
in. A Delta target gets them as one new table version (an overwrite is one commit: readers see the
old version or the new one). Any other table is swapped by renames: the old table is renamed aside
(``<name>__shardtrain_replaced_<id>``), the staging table renamed to the name, the old one dropped.
A process killed in between leaves the old table or no table under the name, never a half-written
one; the next publish to that name (under the caller's writer lock) puts a table left aside back
where no table has the name, and drops staging tables left by killed jobs (``clean_stale_tables``).

Driver-only. Storage listings and fingerprints are ``common.sources``'s; this module only asks the
catalog and runs SQL.
"""

from __future__ import annotations

import contextlib
import logging
import re
import uuid
from dataclasses import dataclass

from common.errors import ConfigError, InputDataError, first_line
from common.faults import fault_point
from common.sql import quote_identifier as q

log = logging.getLogger("shardtrain.tables")

STAGING_TAG = "__shardtrain_staging_"
REPLACED_TAG = "__shardtrain_replaced_"
# Table properties a scores table carries (what overwrite and skip_if_exists check).
KIND_PROPERTY = "shardtrain.kind"
FINGERPRINT_PROPERTY = "shardtrain.input_fingerprint"
_DELTA_LOG_VERSION = re.compile(r"^(\d{20})\.json$")


@dataclass(frozen=True)
class TableInfo:
    name: str  # as the config names it
    provider: str | None  # parquet, delta, hive, csv, ... (lower case); None where the catalog says nothing
    location: str | None  # None for a view
    type: str | None  # MANAGED, EXTERNAL, VIEW


_NOT_IN_A_NAME = re.compile(r"[`;\x00-\x1f\x7f]")  # a statement separator, a quote, control characters


def table_parts(name: str, key: str) -> list[str]:
    """The name's parts (1 to 3, none empty), or exit 2 naming ``key``."""
    parts = [p.strip() for p in str(name).split(".")]
    if not 1 <= len(parts) <= 3 or not all(parts) or any(_NOT_IN_A_NAME.search(p) for p in parts):
        raise ConfigError(f"{key} must name a table as table, schema.table or catalog.schema.table (no ` or ; in a "
                          f"part), got {name!r}")
    return parts


def quote_table(name: str, key: str = "table") -> str:
    return ".".join(q(p) for p in table_parts(name, key))


def table_exists(spark, name: str, key: str = "output.table") -> bool:
    with catalog_errors(name, key):
        return bool(spark.catalog.tableExists(quote_table(name, key)))


def describe_table(spark, name: str, key: str) -> TableInfo:
    """The catalog's word on the table (``DESCRIBE TABLE EXTENDED``: a few rows, no data), or
    exit 2 naming ``key`` where the catalog does not know it."""
    with catalog_errors(name, key):
        rows = spark.sql(f"DESCRIBE TABLE EXTENDED {quote_table(name, key)}").collect()
    detail = {}
    seen_detail = False
    for row in rows:
        label = (row[0] or "").strip()
        if label.startswith("# Detailed Table Information"):
            seen_detail = True
        elif seen_detail and label:
            detail[label.lower()] = (row[1] or "").strip()
    provider = detail.get("provider") or None
    return TableInfo(name=name, provider=provider.lower() if provider else None,
                     location=detail.get("location") or None, type=(detail.get("type") or None))


# The catalog's error classes for a name it cannot place: a catalog it does not have (the session
# catalog reads an unknown first part as a namespace and asks for one part), a schema it does not have.
_UNKNOWN_NAMESPACE = ("REQUIRES_SINGLE_PART_NAMESPACE", "CATALOG_NOT_FOUND", "SCHEMA_NOT_FOUND",
                      "NO_SUCH_NAMESPACE")


@contextlib.contextmanager
def catalog_errors(name: str, key: str):
    """The catalog's refusals of ``name`` as one line naming ``key`` (exit 2): no such table, no such
    catalog or schema. Anything else (a Delta reader missing, the metastore down) passes on."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - AnalysisException, or the Connect client's equivalent
        text = str(exc)
        if any(code in text for code in _UNKNOWN_NAMESPACE):
            raise ConfigError(f"{key}: the session's catalog cannot place {name} ({first_line(exc)}); name a catalog "
                              "and schema it has (SHOW CATALOGS, SHOW SCHEMAS), or drop the catalog part for the "
                              "session catalog") from None
        if "TABLE_OR_VIEW_NOT_FOUND" in text or "not found" in text.lower():
            raise InputDataError(f"{key}: table {name} does not exist in the session's catalog ({first_line(exc)})") \
                from None
        check_delta_reader_error(exc, key)
        raise


def delta_table_version(spark, name: str, key: str) -> int:
    """The latest version in the Delta table's history (``DESCRIBE HISTORY``)."""
    try:
        rows = spark.sql(f"DESCRIBE HISTORY {quote_table(name, key)} LIMIT 1").collect()
    except Exception as exc:  # noqa: BLE001
        check_delta_reader_error(exc, key)
        raise
    if not rows:
        raise InputDataError(f"{key}: Delta table {name} has an empty history")
    return int(rows[0]["version"])


def delta_table_bytes(spark, name: str) -> int | None:
    """``DESCRIBE DETAIL``'s sizeInBytes (the live files), or None where the runtime does not say."""
    try:
        rows = spark.sql(f"DESCRIBE DETAIL {quote_table(name)}").collect()
        return int(rows[0]["sizeInBytes"]) if rows else None
    except Exception:  # noqa: BLE001 - only sizes the job (small or large), never decides what it writes
        return None


def delta_log_version(names: list[str]) -> int | None:
    """The newest commit among a ``_delta_log`` directory's file names (``00000000000000000007.json``)."""
    versions = [int(m.group(1)) for m in map(_DELTA_LOG_VERSION.match, names) if m]
    return max(versions) if versions else None


# --- the Delta reader --------------------------------------------------------------------------

def delta_install_hint() -> str:
    """How to give this pyspark a Delta reader: the delta-spark line that matches it."""
    try:
        import pyspark

        major_minor = tuple(int(x) for x in pyspark.__version__.split(".")[:2])
    except Exception:  # noqa: BLE001
        major_minor = (0, 0)
    if major_minor == (3, 5):
        pip, package = "delta-spark==3.3.2", "io.delta:delta-spark_2.12:3.3.2"
    else:
        pip, package = "delta-spark==4.0.0 (it needs pyspark 4.0.x)", "io.delta:delta-spark_2.13:4.0.0"
    return (f"install {pip} and set spark.conf: {{spark.jars.packages: {package}, spark.sql.extensions: "
            "io.delta.sql.DeltaSparkSessionExtension, spark.sql.catalog.spark_catalog: "
            "org.apache.spark.sql.delta.catalog.DeltaCatalog}} (the jars come from Maven), or run on a Databricks "
            "runtime, which has Delta built in")


def is_missing_delta_reader(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) is Spark's "no data source delta"."""
    seen = 0
    while exc is not None and seen < 8:
        text = str(exc)
        if ("DATA_SOURCE_NOT_FOUND" in text and "delta" in text.lower()) or "find the data source: delta" in text \
                or "find data source: delta" in text:
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def check_delta_reader_error(exc: BaseException, key: str) -> None:
    """Raise exit 2 naming ``key`` with the install hint when ``exc`` says Spark has no Delta reader."""
    if is_missing_delta_reader(exc):
        raise ConfigError(f"{key} needs Spark's Delta reader, which this Spark session does not have "
                          f"(Spark: DATA_SOURCE_NOT_FOUND delta): {delta_install_hint()}") from None


# --- publishing a table ------------------------------------------------------------------------

def _sibling(name: str, tag: str, token: str) -> str:
    parts = table_parts(name, "table")
    return ".".join([*parts[:-1], f"{parts[-1]}{tag}{token}"])


def _rename_target(name: str) -> str:
    """``name`` as ``ALTER TABLE ... RENAME TO`` takes it: without the catalog (a table stays in its
    catalog; Spark's session catalog refuses three parts there, and a v2 catalog would read the
    catalog as a namespace)."""
    return ".".join(q(p) for p in table_parts(name, "table")[-2:])


def _schema_of(name: str) -> str | None:
    parts = table_parts(name, "table")
    return ".".join(q(p) for p in parts[:-1]) if len(parts) > 1 else None


def table_properties(spark, name: str) -> dict[str, str]:
    rows = spark.sql(f"SHOW TBLPROPERTIES {quote_table(name)}").collect()
    return {r["key"]: r["value"] for r in rows}


def _siblings(spark, name: str, tag: str) -> list[str]:
    """Tables beside ``name`` that a publish to it made (``tag``), as full names."""
    parts = table_parts(name, "table")
    schema = _schema_of(name)
    pattern = f"{parts[-1]}{tag}*"
    sql = f"SHOW TABLES IN {schema} LIKE '{pattern}'" if schema else f"SHOW TABLES LIKE '{pattern}'"
    found = []
    for row in spark.sql(sql).collect():
        table = row["tableName"]
        if row.asDict().get("isTemporary"):
            continue
        if table.lower().startswith(f"{parts[-1]}{tag}".lower()):
            found.append(".".join([*parts[:-1], table]))
    return sorted(found)


def clean_stale_tables(spark, name: str) -> list[str]:
    """What killed publishes to ``name`` left (call it under the output's writer lock): a table
    renamed aside comes back where ``name`` is missing (the swap was cut between its renames);
    staging tables and other tables left aside are dropped. Returns what it did, in words."""
    done = []
    replaced = _siblings(spark, name, REPLACED_TAG)
    if replaced and not table_exists(spark, name):
        back = replaced.pop()  # one swap at a time holds the writer lock: at most one is left aside
        spark.sql(f"ALTER TABLE {quote_table(back)} RENAME TO {_rename_target(name)}")
        done.append(f"restored {name} from {back} (a publish was interrupted between its renames)")
    for table in [*replaced, *_siblings(spark, name, STAGING_TAG)]:
        spark.sql(f"DROP TABLE IF EXISTS {quote_table(table)}")
        done.append(f"dropped {table}, left by a killed publish")
    for line in done:
        log.warning("%s", line)
    return done


def write_staging_table(frame, name: str, properties: dict[str, str]) -> str:
    """``frame`` saved as a new staging table beside ``name`` (the session's default table format),
    with ``properties``; returns its name. Nothing is visible under ``name`` yet."""
    staging = _sibling(name, STAGING_TAG, uuid.uuid4().hex[:12])
    frame.write.saveAsTable(staging)
    spark = frame.sparkSession
    props = ", ".join(f"'{k}' = '{v}'" for k, v in properties.items())
    if props:
        spark.sql(f"ALTER TABLE {quote_table(staging)} SET TBLPROPERTIES ({props})")
    return staging


def swap_in(spark, staging: str, name: str, key: str) -> None:
    """Make the staging table the table ``name`` (see the module docstring), then drop the staging
    table or what it replaced."""
    fault_point("table", "before-swap")
    exists = table_exists(spark, name)
    if exists and describe_table(spark, name, key).provider == "delta":
        # One overwrite commit: readers see the previous version or this one.
        props = table_properties(spark, staging)
        spark.table(staging).write.format("delta").mode("overwrite").option("overwriteSchema", "true") \
            .saveAsTable(name)
        ours = ", ".join(f"'{k}' = '{v}'" for k, v in props.items() if k.startswith("shardtrain."))
        if ours:
            spark.sql(f"ALTER TABLE {quote_table(name)} SET TBLPROPERTIES ({ours})")
        spark.sql(f"DROP TABLE IF EXISTS {quote_table(staging)}")
        return
    aside = None
    if exists:
        aside = _sibling(name, REPLACED_TAG, uuid.uuid4().hex[:12])
        spark.sql(f"ALTER TABLE {quote_table(name)} RENAME TO {_rename_target(aside)}")
        fault_point("table", "after-aside")
    spark.sql(f"ALTER TABLE {quote_table(staging)} RENAME TO {_rename_target(name)}")
    fault_point("table", "after-swap")
    if aside is not None:
        spark.sql(f"DROP TABLE IF EXISTS {quote_table(aside)}")


__all__ = ["FINGERPRINT_PROPERTY", "KIND_PROPERTY", "REPLACED_TAG", "STAGING_TAG", "TableInfo",
           "check_delta_reader_error", "clean_stale_tables", "delta_install_hint", "delta_log_version",
           "delta_table_bytes", "delta_table_version", "describe_table", "is_missing_delta_reader", "quote_table",
           "swap_in", "table_exists", "table_parts", "table_properties", "write_staging_table"]
