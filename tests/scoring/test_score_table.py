"""``output.table``: `shardtrain score` writes its scores to a catalog table, atomically, with the
accounting, config and quarantine at ``output.path`` beside it.

In the test session's own local Spark (an in-memory catalog, a database of this module's own
under a temporary directory): the scores read back from the table equal the scores written to a
path by the same job (same rows, same values, same accounting and quarantine); a table source is
scored like a path source; the modes hold for the table (error refuses it, skip_if_exists skips an
identical one, overwrite replaces only a scores table), and no staging table is left behind.

Killed mid-publish (a real Hive metastore on embedded Derby, so tables outlive the process: the
score command in a process of its own, stopped at the fault point, then SIGKILLed by pid, its
driver JVM too): killed between the swap's two renames, no table has the name (the old one is
aside, whole); the next run puts the old table back before anything else, then publishes, leaving
no staging table; killed after the staging table was written, the old table is there, unchanged.
Each killed state is read from the metastore's own tables (hive_table_reader.read_metastore: JDBC
in a JVM of its own, no Spark) and the Parquet at each table's location; each published table also
by Spark with the metastore as its catalog, which sees the same tables and rows. Each publish,
Spark's read of it and the killed overwrite after it share one process (one Spark start-up): two
in all."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from common.errors import ConfigError, OutputExistsError
from common.faults import FAULT_ENV, FAULT_ONCE_ENV
from common.publish import read_marker
from common.tables import FINGERPRINT_PROPERTY, KIND_PROPERTY, table_properties
from hive_table_reader import hive_conf, read_metastore
from polling import wait_for
from scoring.job import score
from tabular_data import raw_frame, write_dataset
from train_configs import train_config
from training import train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))

pytestmark = [pytest.mark.spark, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("score-table")
    ds = write_dataset(str(root / "ds"), {"train": [[400]], "val": [[100]]})
    cfg = train_config(ds, f"{root}/model", "train.epochs=2", "train.batch_size=32", "train.lr=0.01",
                       "model.hidden=[8]", "data.shuffle_buffer_rows=100")
    return train(cfg).model_uri


@pytest.fixture(scope="module")
def schema(spark, tmp_path_factory):
    name = f"shardtrain_scores_{uuid.uuid4().hex[:8]}"
    spark.sql(f"CREATE DATABASE {name} LOCATION 'file:{tmp_path_factory.mktemp('warehouse') / name}'")
    yield f"spark_catalog.{name}"
    spark.sql(f"DROP DATABASE {name} CASCADE")


def raw_source(root, rows: int = 240) -> str:
    """Raw rows with an ``id`` and three the model cannot take (x1 not finite: quarantined)."""
    frame = raw_frame(rows, seed=5).drop(columns=["label"])
    frame.insert(0, "id", np.arange(rows, dtype=np.int64))
    frame.loc[[3, 50, 201], "x1"] = np.inf
    os.makedirs(root, exist_ok=True)
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), os.path.join(root, "part-0.parquet"))
    return str(root)


def score_yaml(path, model: str, output: dict, sources: dict, spark: dict | None = None) -> str:
    cfg = {"model": model, "sources": sources, "output": {"keep_columns": ["id"], **output}, "batch_size": 64}
    if spark:
        cfg["spark"] = spark
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _sorted(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.sort_values("id").reset_index(drop=True)


def _quarantine(root) -> pd.DataFrame:
    return pd.read_parquet(os.path.join(root, "_quarantine")).sort_values("raw").reset_index(drop=True)


def _leftovers(spark, schema: str) -> list[str]:
    return [r["tableName"] for r in spark.sql(f"SHOW TABLES IN {schema}").collect() if "__shardtrain_" in r["tableName"]]


@pytest.mark.stack  # the catalog and table rename of each Spark version
def test_scores_in_a_table_equal_scores_at_a_path(spark, model, schema, tmp_path, monkeypatch):
    source = {"raw": {"path": raw_source(tmp_path / "raw")}}
    path_config = score_yaml(tmp_path / "p.yaml", model, {"path": str(tmp_path / "scores")}, source)
    at_path = score(path_config, spark=spark)
    table = f"{schema}.scores"
    acc = tmp_path / "accounting"
    in_table = score(score_yaml(tmp_path / "t.yaml", model, {"path": str(acc), "table": table}, source), spark=spark)
    assert (in_table.scored_rows, in_table.quarantined_rows) == (at_path.scored_rows, at_path.quarantined_rows) == \
        (237, 3)
    assert f"published table {table} (accounting in {acc})" in in_table.summary()

    expected = _sorted(pd.read_parquet(tmp_path / "scores", engine="pyarrow"))
    got = _sorted(spark.table(table).toPandas())
    assert list(got.columns) == list(expected.columns) == ["id", "probabilities", "prediction"]
    assert got["id"].tolist() == expected["id"].tolist()
    np.testing.assert_array_equal(np.stack(got["probabilities"]), np.stack(expected["probabilities"]))
    assert got["prediction"].tolist() == expected["prediction"].tolist()

    # The accounting and quarantine beside the table, at output.path: as the path output has them.
    ours, theirs = (json.loads((root / "_scores.json").read_text()) for root in (acc, tmp_path / "scores"))
    assert ours["accounting"] == theirs["accounting"] == {"input_rows": 240, "scored_rows": 237, "quarantined_rows": 3}
    assert ours["quarantine"] == theirs["quarantine"] and ours["table"] == table
    pd.testing.assert_frame_equal(_quarantine(acc), _quarantine(tmp_path / "scores"))
    assert not [n for n in os.listdir(acc) if n.endswith(".parquet")]  # no scores at the path: they are in the table
    props = table_properties(spark, table)
    assert props[KIND_PROPERTY] == "shardtrain.scores" and props[FINGERPRINT_PROPERTY] == \
        read_marker(str(acc))["input_fingerprint"]
    assert _leftovers(spark, schema) == []

    # Given no session, a job that its output's mode settles (these scores are there: skipped; or
    # refused) starts no Spark: `shardtrain score ... output.mode=skip_if_exists` costs no JVM.
    from common import spark as spark_module

    def no_spark(*args, **kwargs):
        raise AssertionError("the score job asked for a SparkSession before its output's mode settled it")

    monkeypatch.setattr(spark_module, "get_or_create_session", no_spark)
    again = score(path_config, ["output.mode=skip_if_exists"])
    assert again.skipped and (again.scored_rows, again.quarantined_rows) == (237, 3)
    with pytest.raises(OutputExistsError, match="set output.mode"):
        score(path_config)


@pytest.mark.stack  # the catalog and table rename of each Spark version
def test_a_score_table_keeps_the_modes_and_a_table_source_scores_like_a_path(spark, model, schema, tmp_path):
    raw = raw_source(tmp_path / "raw")
    spark.read.parquet(raw).write.saveAsTable(f"{schema}.raw_rows")
    table, acc = f"{schema}.modes", str(tmp_path / "acc")
    config = score_yaml(tmp_path / "t.yaml", model, {"path": acc, "table": table},
                        {"raw": {"table": f"{schema}.raw_rows"}})
    first = score(config, spark=spark)
    from_path = score(score_yaml(tmp_path / "p.yaml", model, {"path": str(tmp_path / "p")}, {"raw": {"path": raw}}),
                      spark=spark)
    assert (first.scored_rows, first.quarantined_rows) == (from_path.scored_rows, from_path.quarantined_rows)
    files = sorted(os.listdir(table_location(spark, table)))

    with pytest.raises(OutputExistsError, match=f"output.table {table} already exists; set output.mode=overwrite"):
        score(config, ["output.path=" + str(tmp_path / "acc2")], spark=spark)
    assert score(config, ["output.mode=skip_if_exists"], spark=spark).skipped
    assert sorted(os.listdir(table_location(spark, table))) == files  # untouched
    before = _sorted(spark.table(table).toPandas())
    score(config, ["output.mode=overwrite", "temperature=3.0"], spark=spark)
    after = _sorted(spark.table(table).toPandas())
    assert after["id"].tolist() == before["id"].tolist()
    assert not np.array_equal(np.stack(after["probabilities"]), np.stack(before["probabilities"]))
    assert _leftovers(spark, schema) == []

    spark.range(3).write.saveAsTable(f"{schema}.someone_elses")
    with pytest.raises(ConfigError, match="was not written by a score job"):
        score(config, [f"output.table={schema}.someone_elses", "output.mode=overwrite",
                       f"output.path={tmp_path / 'acc3'}"], spark=spark)
    assert spark.table(f"{schema}.someone_elses").count() == 3
    with pytest.raises(ConfigError, match="output.table is the table of source 'raw'"):
        score(config, [f"output.table={schema}.raw_rows"], spark=spark)


def table_location(spark, table: str) -> str:
    from common.tables import describe_table

    return describe_table(spark, table, "table").location.replace("file:", "", 1)


# --- killed mid-publish, in a process of its own (a Hive metastore outlives it) -------------------

def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    if int(fh.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return found


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None  # gone


def _kill_at(proc: subprocess.Popen, fault: str, pid_file, log=None) -> None:
    """Wait until ``proc`` (a score command) stops itself at ``fault``, then SIGKILL it (and its
    driver JVM) by pid, and prove both died."""
    try:
        wait_for(lambda: pid_file.exists() and _state(proc.pid) == "T", f"the score job to stop at {fault}",
                 timeout=900, proc=proc, log=log, interval=0.2)
        assert int(pid_file.read_text()) == proc.pid
        jvms = _children(proc.pid)
        assert jvms, "the stopped score job has no driver JVM child"
        os.kill(proc.pid, signal.SIGKILL)
        for jvm in jvms:
            os.kill(jvm, signal.SIGKILL)
        proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL  # it died by our signal, not at its own hand
        wait_for(lambda: all(_state(j) in (None, "Z") for j in jvms), "the driver JVM to die", timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _reader_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, FAULT_ONCE_ENV)}
    return {**env, "PYTHONPATH": ROOT}


def _publish_read_then_kill_at(root, config: str, first: list[str], fault: str, pid_file, log,
                               then: list[str]) -> tuple[str, dict]:
    """`shardtrain score` (main(argv)) with ``first`` in a process of its own, Spark's read of the
    metastore it published to, then in that process (the same Spark application: one start-up for
    the three) a second score command with ``then`` that stops itself at ``fault``: killed there by
    pid (``_kill_at``). Returns the process's output and what Spark read after the first command."""
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, os.path.join(HERE, "hive_table_reader.py"), str(root), "default",
                                 "--score", "--config", config, *first, "--then-stop-at", fault, str(pid_file),
                                 "--config", config, *then],
                                env=_reader_env(), cwd=root, stdout=out, stderr=subprocess.STDOUT)
    _kill_at(proc, fault, pid_file, log=log)
    output = log.read_text()
    lines = [line for line in output.splitlines() if line.startswith("READ ")]
    assert "SCORED 0" in output and len(lines) == 1, output[-3000:]
    return output, json.loads(lines[0][len("READ "):])


@pytest.mark.process
@pytest.mark.timeout(1800)  # two Spark start-ups with a Hive metastore, on a shared machine
def test_a_score_job_killed_mid_publish_leaves_the_old_table_or_none(model, tmp_path):
    metastore = tmp_path / "hive"
    metastore.mkdir()
    config = score_yaml(tmp_path / "score.yaml", model, {"path": str(tmp_path / "acc"), "table": "default.scores"},
                        {"raw": {"path": raw_source(tmp_path / "raw")}},
                        spark={"master": "local[1]", "conf": hive_conf(str(metastore))})
    overwrite = ["output.mode=overwrite"]
    # The first publish (the old table, as Spark reads it), then an overwrite killed between the
    # swap's renames: no table has the name (never a half one); the old one is aside, whole.
    _, old = _publish_read_then_kill_at(metastore, config, [], "table:after-aside", tmp_path / "after-aside.pid",
                                        tmp_path / "first.log", [*overwrite, "temperature=3.0"])
    assert list(old) == ["scores"] and len(old["scores"]) == 237
    found = read_metastore(str(metastore))
    assert "scores" not in found
    aside = [t for t in found if t.startswith("scores__shardtrain_replaced_")]
    assert len(aside) == 1 and found[aside[0]] == old["scores"]
    left = [t for t in found if t.startswith("scores__shardtrain_staging_")]  # the killed job's new scores
    assert sorted(found) == sorted([*aside, *left]) and len(left) == 1 and len(found[left[0]]) == 237

    # The next run puts the old table back first, then publishes the new scores; nothing is left
    # beside (the killed run's staging table dropped too), as Spark, with the metastore as its
    # catalog, reads it. Then, in that process, an overwrite killed with its scores complete in a
    # staging table: the table is there, as it was.
    output, new = _publish_read_then_kill_at(metastore, config, [*overwrite, "temperature=3.0"], "table:before-swap",
                                             tmp_path / "before-swap.pid", tmp_path / "second.log",
                                             [*overwrite, "temperature=2.0"])
    assert f"restored default.scores from default.{aside[0]}" in output
    assert list(new) == ["scores"] and [r[0] for r in new["scores"]] == [r[0] for r in old["scores"]]
    assert new["scores"] != old["scores"]  # temperature 3: other probabilities
    found = read_metastore(str(metastore))
    # The metastore's own tables and Spark with it as its catalog: the same table and rows.
    assert found["scores"] == new["scores"]
    staging = [t for t in found if t.startswith("scores__shardtrain_staging_")]
    assert sorted(found) == sorted(["scores", *staging]) and len(staging) == 1
    # The killed job's scores (temperature 2), complete, never under the name.
    assert len(found[staging[0]]) == 237 and found[staging[0]] != new["scores"]
