"""``sources.<name>.table`` and ``format: delta`` on real local Spark: Parquet-backed tables saved
with ``saveAsTable`` into a database of this module's own (its location a temporary directory,
so nothing lands in the working directory's spark-warehouse) give the same shard files as the
same rows read from a path; a table's fingerprint changes when rows are inserted and not
otherwise, so ``skip_if_exists`` skips a rerun and refuses a changed table; the output may not
sit inside a table's location; config mistakes name the key. Delta: no Delta reader can be
installed here (its jars come from Maven), so the tests check the exit-2 message with the install
hint, and the fingerprint of a Delta directory (its newest ``_delta_log`` commit), on a Delta
table written by hand to the protocol (one commit: protocol, metaData, add)."""

from __future__ import annotations

import json
import os
import uuid

import pyarrow.parquet as pq
import pytest

from common.errors import ConfigError, InputDataError, OutputExistsError
from common.sources import source_fingerprint
from pipelines.shard_job import run_shard_job
from shard_testdata import config, file_hashes, simple_rows, write_parquet

# Marked stack, test by test: what runs on Spark; not the config checks and the Delta log read, plain Python.
pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def schema(spark, tmp_path_factory):
    """A database of this module's own, its tables under a temporary directory."""
    name = f"shardtrain_tables_{uuid.uuid4().hex[:8]}"
    location = tmp_path_factory.mktemp("warehouse") / name
    spark.sql(f"CREATE DATABASE {name} LOCATION 'file:{location}'")
    yield f"spark_catalog.{name}"
    spark.sql(f"DROP DATABASE {name} CASCADE")


def _table_config(table: str, output_path: str, **sections):
    return config("unused", output_path, sources={"raw": {"table": table}}, **sections)


@pytest.mark.stack
def test_a_table_gives_the_same_shards_as_the_same_rows_from_a_path(spark, schema, tmp_path):
    path = write_parquet(tmp_path / "raw", simple_rows(300))
    table = f"{schema}.same_rows"
    spark.read.parquet(path).write.format("parquet").saveAsTable(table)

    from_path = run_shard_job(spark, config(path, str(tmp_path / "from-path")))
    from_table = run_shard_job(spark, _table_config(table, str(tmp_path / "from-table")))
    assert from_table.manifest.data["accounting"] == from_path.manifest.data["accounting"]
    hashes = file_hashes(str(tmp_path / "from-path"))
    assert len(hashes) >= 3 and file_hashes(str(tmp_path / "from-table")) == hashes
    source = from_table.manifest.data["sources"]["raw"]
    assert source["table"] == table and source["format"] == "parquet"
    assert source["location"].endswith("/same_rows") and source["files"]


@pytest.mark.stack
def test_the_fingerprint_follows_the_table_so_skip_if_exists_skips_only_an_unchanged_one(spark, schema, tmp_path):
    table = f"{schema}.growing"
    spark.read.parquet(write_parquet(tmp_path / "raw", simple_rows(200))).write.saveAsTable(table)
    cfg = _table_config(table, str(tmp_path / "out"), output={"mode": "skip_if_exists"})
    first = source_fingerprint("raw", cfg.sources["raw"], spark)
    assert source_fingerprint("raw", cfg.sources["raw"], spark) == first  # nothing changed: the same
    published = run_shard_job(spark, cfg)
    assert not published.skipped and published.manifest.data["accounting"]["input_rows"] == 200
    manifest_bytes = (tmp_path / "out" / "_manifest.json").read_bytes()
    again = run_shard_job(spark, cfg)
    assert again.skipped and (tmp_path / "out" / "_manifest.json").read_bytes() == manifest_bytes

    spark.sql(f"INSERT INTO {table} VALUES (1000, 1.5, 'k1', 1), (1001, 2.5, 'k2', 0)")
    changed = source_fingerprint("raw", cfg.sources["raw"], spark)
    assert changed != first and len(changed["files"]) > len(first["files"])
    with pytest.raises(OutputExistsError, match="changed since it was written"):
        run_shard_job(spark, cfg)
    assert (tmp_path / "out" / "_manifest.json").read_bytes() == manifest_bytes
    cfg.output.mode = "overwrite"
    assert run_shard_job(spark, cfg).manifest.data["accounting"]["input_rows"] == 202


@pytest.mark.stack
def test_the_output_may_not_sit_inside_a_tables_location(spark, schema, tmp_path):
    table = f"{schema}.located"
    spark.read.parquet(write_parquet(tmp_path / "raw", simple_rows(50))).write.saveAsTable(table)
    location = source_fingerprint("raw", _table_config(table, str(tmp_path / "x")).sources["raw"], spark)["location"]
    inside = location.replace("file:", "", 1) + "/shards"
    with pytest.raises(ConfigError, match=r"output.path .* is inside source 'raw' \(sources.raw.table "):
        run_shard_job(spark, _table_config(table, inside))
    assert not os.path.exists(inside)


@pytest.mark.parametrize("source, message", [
    ({"path": "/x", "table": "db.t"}, "sources.raw.path or table must be set (exactly one)"),
    ({"format": "parquet"}, "sources.raw.path or table must be set (exactly one)"),
    ({"table": "db.t", "format": "csv"}, "sources.raw.format applies to a path"),
    ({"table": "db.t", "schema": "id BIGINT"}, "sources.raw.schema applies to a path"),
    ({"table": "a..b"}, "sources.raw.table must name a table as table, schema.table or catalog.schema.table"),
    ({"table": "db.t;DROP TABLE x"}, "sources.raw.table must name a table as table, schema.table or catalog.schema"),
    ({"path": "/x", "format": "delta", "schema": "id BIGINT"}, "sources.raw.schema applies to csv, json and parquet"),
])
def test_source_config_mistakes_name_the_key(source, message):
    with pytest.raises(ConfigError) as err:
        config("unused", "/tmp/out", sources={"raw": source})
    assert message in str(err.value) and err.value.exit_code == 2


@pytest.mark.stack
def test_a_missing_table_or_catalog_names_its_key(spark, schema, tmp_path):
    with pytest.raises(InputDataError, match=f"sources.raw.table: table {schema}.nowhere does not exist"):
        run_shard_job(spark, _table_config(f"{schema}.nowhere", str(tmp_path / "out")))
    # A catalog the session does not have (the session catalog reads it as a namespace): exit 2, one line.
    elsewhere = f"nocatalog.{schema.split('.')[-1]}.t"
    with pytest.raises(ConfigError, match=rf"^sources.raw.table: the session's catalog cannot place {elsewhere} "
                                          r"\(.*\); name a catalog and schema it has") as err:
        run_shard_job(spark, _table_config(elsewhere, str(tmp_path / "out")))
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def write_delta_table(root, rows: dict) -> str:
    """A Delta table as the protocol defines it (reader 1 / writer 2): Parquet data plus a first
    commit (protocol, metaData, add), written without Spark."""
    root.mkdir(parents=True)
    write_parquet(root, rows)
    data = root / "part-0.parquet"
    fields = [{"name": f.name, "type": {"int64": "long", "double": "double", "string": "string"}[str(f.type)],
               "nullable": True, "metadata": {}} for f in pq.read_schema(data)]
    actions = [
        {"protocol": {"minReaderVersion": 1, "minWriterVersion": 2}},
        {"metaData": {"id": str(uuid.uuid4()), "format": {"provider": "parquet", "options": {}},
                      "schemaString": json.dumps({"type": "struct", "fields": fields}), "partitionColumns": [],
                      "configuration": {}, "createdTime": 0}},
        {"add": {"path": data.name, "partitionValues": {}, "size": data.stat().st_size,
                 "modificationTime": int(data.stat().st_mtime * 1000), "dataChange": True}},
    ]
    (root / "_delta_log").mkdir()
    (root / "_delta_log" / f"{0:020d}.json").write_text("\n".join(json.dumps(a) for a in actions) + "\n")
    return str(root)


@pytest.mark.stack
def test_format_delta_without_a_delta_reader_is_exit_2_with_the_install_hint(spark, tmp_path):
    delta = write_delta_table(tmp_path / "delta", simple_rows(40))
    cfg = config(delta, str(tmp_path / "out"), fmt="delta")
    with pytest.raises(ConfigError) as err:
        run_shard_job(spark, cfg)
    text = str(err.value)
    assert err.value.exit_code == 2
    assert text.startswith("sources.raw.path needs Spark's Delta reader, which this Spark session does not have")
    assert "delta-spark" in text and "spark.jars.packages: io.delta:delta-spark_2.1" in text and "Databricks" in text
    assert not (tmp_path / "out").exists()


def test_a_delta_paths_fingerprint_is_its_newest_commit(tmp_path):
    delta = write_delta_table(tmp_path / "delta", simple_rows(40))
    source = config(delta, str(tmp_path / "out"), fmt="delta").sources["raw"]
    first = source_fingerprint("raw", source)
    assert first["version"] == 0 and source_fingerprint("raw", source) == first
    commit = {"commitInfo": {"operation": "SET TBLPROPERTIES"}}
    (tmp_path / "delta" / "_delta_log" / f"{1:020d}.json").write_text(json.dumps(commit) + "\n")
    assert source_fingerprint("raw", source)["version"] == 1
    with pytest.raises(InputDataError, match="has no Delta log"):
        source_fingerprint("raw", config(write_parquet(tmp_path / "plain", simple_rows(5)), "/tmp/o",
                                         fmt="delta").sources["raw"])
