"""Bad inputs that used to be published silently (issue 9, item 7), each on real Spark: an
all-null numeric feature, undecodable bytes, an overlong category, duplicate CSV header names,
an empty split, a raw Parquet directory given to training, and numbers float32 cannot hold."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet  # noqa: F401 - pa.parquet
import pytest

from common.features import FeatureSpec

from common.dataset import read_manifest
from common.errors import ConfigError, DatasetError, InputDataError
from pipelines.shard_job import run_shard_job
from shard_testdata import config, quarantine, read_split, simple_rows, write_parquet

# Marked stack, test by test: what runs on Spark; not the manifest's own checks, plain Python.
pytestmark = pytest.mark.spark


def _csv(path: Path, header: bytes, lines: list[bytes]) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "d.csv").write_bytes(header + b"\n" + b"\n".join(lines) + b"\n")
    return str(path)


@pytest.mark.stack
def test_an_all_null_numeric_feature_is_an_error_naming_it_unless_imputed(spark, tmp_path):
    rows = simple_rows(40)
    rows["empty"] = [None] * 40
    schema = pa.schema([("id", pa.int64()), ("x", pa.float64()), ("c", pa.string()), ("y", pa.int64()),
                        ("empty", pa.float64())])
    src = write_parquet(tmp_path / "in", rows, schema=schema)
    out = tmp_path / "out"
    features = {"numeric": ["x", "empty"], "categorical": ["c"]}
    with pytest.raises(InputDataError, match=r"numeric feature column\(s\) \['empty'\] \(features.numeric\) have no "
                                             r"value in any train row") as err:
        run_shard_job(spark, config(src, str(out), features=features))
    assert err.value.exit_code == 2
    assert not out.exists()
    # With features.impute the user says what to store: every row holds that value.
    result = run_shard_job(spark, config(src, str(out), features={**features, "impute": {"empty": 3.5}}))
    assert set(read_split(result.uri, "train").column("empty").to_pylist()) == {3.5}


@pytest.mark.stack
def test_undecodable_bytes_quarantine_the_row_as_bad_encoding(spark, tmp_path):
    lines = [f"{i},{i % 7}.0,k{i % 3},{i % 2}".encode() for i in range(30)]
    lines[5] = b"5,5.0,caf\xe9,1"  # Latin-1 e-acute: not valid UTF-8
    src = _csv(tmp_path / "in", b"id,x,c,y", lines)
    cfg = config(src, str(tmp_path / "out"), fmt="csv",
                 sources={"raw": {"path": src, "format": "csv", "options": {"header": True},
                                  "schema": "id BIGINT, x DOUBLE, c STRING, y INT"}})
    result = run_shard_job(spark, cfg)
    assert result.manifest.data["quarantine"]["by_reason"] == {"bad_encoding": 1}
    q = quarantine(result.uri)
    assert json.loads(q["raw"].iloc[0])["id"] == 5
    vocab = result.manifest.features.by_kind()["categorical"][0]["vocab"]
    assert sorted(vocab) == ["k0", "k1", "k2"] and not any("\ufffd" in v for v in vocab)


@pytest.mark.stack
def test_a_category_longer_than_max_category_bytes_is_quarantined(spark, tmp_path):
    rows = simple_rows(30)
    rows["c"][3] = "v" * 2000
    rows["c"][4] = "é" * 600  # 1200 UTF-8 bytes: the limit counts bytes, not characters
    src = write_parquet(tmp_path / "in", rows)
    result = run_shard_job(spark, config(src, str(tmp_path / "out")))
    assert result.manifest.data["quarantine"]["by_reason"] == {"too_long:c": 2}
    vocab = result.manifest.features.by_kind()["categorical"][0]["vocab"]
    assert max(len(v.encode()) for v in vocab) <= 1024
    # The limit is a config key.
    result = run_shard_job(spark, config(src, str(tmp_path / "out2"), features={"max_category_bytes": 4000}))
    assert result.manifest.data["quarantine"]["rows"] == 0


@pytest.mark.stack
@pytest.mark.parametrize("schema", [None, "id BIGINT, x DOUBLE, c STRING, y INT"])
def test_duplicate_csv_header_names_are_an_error_even_with_a_schema(spark, tmp_path, schema):
    lines = [f"{i},{i % 7}.0,k{i % 3},{i % 2}".encode() for i in range(30)]
    src = _csv(tmp_path / "in", b"id,x,X,y", lines)
    source = {"path": src, "format": "csv", "options": {"header": True}}
    if schema:
        source["schema"] = schema
    out = tmp_path / "out"
    with pytest.raises(InputDataError, match=r"source 'raw': the CSV header of .*d.csv names column\(s\) \['X'\] "
                                             r"more than once") as err:
        run_shard_job(spark, config(src, str(out), fmt="csv", sources={"raw": source}))
    assert err.value.exit_code == 2 and not out.exists()


@pytest.mark.stack
def test_a_split_with_no_rows_says_so(spark, tmp_path):
    rows = simple_rows(40)
    rows["id"] = [7] * 40  # one split key: every row lands in the same split
    src = write_parquet(tmp_path / "in", rows)
    cfg = config(src, str(tmp_path / "out"), split={"key": "id", "fractions": {"train": 0.5, "val": 0.5}})
    with pytest.raises(InputDataError, match=r"split '(train|val)' has 0 rows") as err:
        run_shard_job(spark, cfg)
    assert "lower output.num_shards" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_a_raw_parquet_directory_is_not_a_shardtrain_dataset(tmp_path):
    src = write_parquet(tmp_path / "raw", simple_rows(10))
    with pytest.raises(DatasetError, match=rf"{src} is not a shardtrain dataset") as err:
        read_manifest(src)
    assert "incomplete" not in str(err.value) and err.value.exit_code == 2


@pytest.mark.stack
def test_a_source_file_that_cannot_be_read_is_one_line_naming_it(spark, tmp_path):
    """Listing the source hits a file it cannot stat (a symbolic link to itself: ELOOP, which even
    root gets; an unreadable directory would do for other users): one line naming that path, exit 1."""
    from common.errors import EXIT_RUNTIME, StorageIOError

    src = write_parquet(tmp_path / "in", simple_rows(20))
    loop = tmp_path / "in" / "part-1.parquet"
    loop.symlink_to(loop)
    with pytest.raises(OSError):
        loop.stat()  # proof the entry really cannot be read
    with pytest.raises(StorageIOError) as err:
        run_shard_job(spark, config(src, str(tmp_path / "out")))
    message = str(err.value)
    assert message.startswith(f"{loop}: ") and "Too many levels of symbolic links" in message, message
    assert "\n" not in message and err.value.exit_code == EXIT_RUNTIME
    assert not (tmp_path / "out").exists()


@pytest.mark.stack  # Spark's own words for a damaged footer differ between 3.5 and 4.x
@pytest.mark.parametrize("damage", ["empty", "garbage"])
def test_a_source_file_that_is_not_parquet_is_exit_2_naming_it(spark, tmp_path, damage):
    """A 0-byte file beside good ones (refused from the listing, before Spark reads a footer) and 100
    bytes of garbage (refused from Spark's error): one line naming the file, exit 2, nothing written."""
    src = write_parquet(tmp_path / "in", simple_rows(20))
    bad = tmp_path / "in" / "part-9.parquet"
    bad.write_bytes(b"" if damage == "empty" else bytes(range(100)))
    with pytest.raises(InputDataError) as err:
        run_shard_job(spark, config(src, str(tmp_path / "out")))
    message = str(err.value)
    assert str(bad) in message and ("sources.raw.path" in message or "remove or replace that file" in message), message
    assert "\n" not in message and err.value.exit_code == 2
    assert not (tmp_path / "out").exists()


def _strict_json(text: str):
    """json.loads that refuses NaN and Infinity, as every JSON reader but Python's does."""
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.stack
def test_values_float32_cannot_hold_are_quarantined_and_the_statistics_stay_finite(spark, tmp_path):
    """1e300 (and -1e300), inf and NaN in a numeric feature, beside valid rows up to float32's
    largest value: the bad rows are quarantined as non_finite:<col>, the train statistics are
    finite, the manifest is strict JSON and the valid rows are stored standardized (not all 0)."""
    rows = simple_rows(40)
    bad = {40: 1e300, 41: -1e300, 42: float("inf"), 43: float("nan")}
    rows["id"] += list(bad)
    rows["x"] += list(bad.values())
    rows["c"] += ["k1"] * len(bad)
    rows["y"] += [1] * len(bad)
    rows["x"][7] = 3.0e38  # a valid neighbour: float32 holds it
    src = write_parquet(tmp_path / "in", rows)
    assert pa.parquet.read_table(src).column("x").to_pylist()[40] == 1e300  # the input really holds it
    result = run_shard_job(spark, config(src, str(tmp_path / "out")))
    assert result.manifest.data["quarantine"]["by_reason"] == {"non_finite:x": 4}
    q = quarantine(result.uri)
    assert sorted(json.loads(raw)["id"] for raw in q["raw"]) == sorted(bad)
    manifest = _strict_json((Path(result.uri) / "_manifest.json").read_text())
    (stats,) = FeatureSpec(manifest["features"]).by_kind()["numeric"]
    assert all(map(math.isfinite, (stats["mean"], stats["std"], stats["fill"]))) and stats["std"] > 1e36
    stored = read_split(result.uri, "train").column("x").to_numpy()
    assert len(stored) == 40 and np.isfinite(stored).all() and stored.max() > 5  # 3e38 stands out


def test_the_manifest_writer_refuses_a_non_finite_number(tmp_path):
    from common.manifest_builder import write_manifest
    from common.storage import resolve

    root = resolve(str(tmp_path))
    with pytest.raises(DatasetError, match="the manifest would hold a non-finite number") as err:
        write_manifest(root, {"features": {"numeric": [{"name": "x", "std": float("inf")}]}})
    assert err.value.exit_code == 2 and not (tmp_path / "_manifest.json").exists()


@pytest.mark.stack
def test_a_query_that_writes_is_refused_before_anything_runs_and_the_directory_survives(spark, tmp_path, capsys):
    """``spark.sql`` runs any statement: an INSERT OVERWRITE DIRECTORY given as the query deleted
    that directory's files. Now the config refuses it, naming the key, before Spark is asked."""
    import yaml

    from scoring.config import load_score_config
    from shardtrain.cli import main

    def victim(name):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "precious.txt").write_text("keep me")
        return folder

    probe = "INSERT OVERWRITE DIRECTORY '{dir}' USING parquet SELECT 1 AS x"
    shown = victim("shown")
    spark.sql(probe.format(dir=shown))  # what the probe does when Spark runs it: the files are gone
    assert not (shown / "precious.txt").exists()

    src = write_parquet(tmp_path / "in", simple_rows(20))
    target = victim("target")
    for query in (probe.format(dir=target), f"WITH t AS (SELECT * FROM raw) {probe.format(dir=target)}",
                  f"FROM raw INSERT OVERWRITE DIRECTORY '{target}' SELECT *", "SELECT * FROM raw; DROP TABLE raw"):
        cfg = {"sources": {"raw": {"path": src}}, "query": query,
               "features": {"numeric": ["x"], "categorical": ["c"]},
               "label": {"column": "y", "task": "classification", "num_classes": 2},
               "split": {"key": "id"}, "output": {"path": str(tmp_path / "out"), "num_shards": 2}}
        path = tmp_path / "shard.yaml"
        path.write_text(yaml.safe_dump(cfg))
        assert main(["shard", "--config", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"shardtrain: error: {path}: query must be a single SELECT query"), err
        with pytest.raises(ConfigError, match=r"query must be a single SELECT query"):
            load_score_config(None, [f"sources.raw.path={src}", f"query={query}", "model=/m", "output.path=/o"])
    assert (target / "precious.txt").read_text() == "keep me"
    assert not (tmp_path / "out").exists()
    # A query that reads is accepted (test_shard_job.py runs one).
    assert config(src, str(tmp_path / "out"), query="SELECT * FROM raw -- INSERT OVERWRITE").query.startswith("SELECT")
