"""`shardtrain score` and its core, on real Spark (local[2]) with a tiny model trained in-process once
per module: the scores equal ``load_model(uri).predict`` on the same rows (nulls, unseen categories,
array columns; classification at any temperature, regression); a row the model's preprocessing
cannot take is quarantined with a reason naming its column; rows in = scored + quarantined; the
output is published atomically with a ``shardtrain.scores`` marker and the mode rules; exit status."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from common.commit_marker import MARKER
from common.dataset import read_manifest
from common.errors import InputDataError
from common.spark import EXECUTOR_SHARDTRAIN_FIX
from scoring.predict import predict_frame
from tabular_data import raw_frame, write_dataset
from train_configs import train_config
from training import load_model, train

# Marked stack, test by test: what runs the score job (each pyspark) or predict (each pandas/numpy);
# not the checks of config and SQL text, which are the same code on both profiles.

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARDTRAIN = os.path.join(os.path.dirname(sys.executable), "shardtrain")
SHAPE = (4,)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A classification and a regression model (array feature included), each trained in-process on
    a tiny dataset; and that dataset, for scoring its stored rows."""
    root = tmp_path_factory.mktemp("score")
    found = {}
    for task in ("classification", "regression"):
        ds = write_dataset(str(root / f"ds-{task}"), {"train": [[500]], "val": [[120]]}, task=task,
                           array_shape=SHAPE)
        cfg = train_config(ds, f"{root}/{task}", "train.epochs=2", "train.batch_size=32", "train.lr=0.01",
                           "model.hidden=[8]", "data.shuffle_buffer_rows=100")
        found[task] = train(cfg).model_uri
        found[f"{task}-dataset"] = ds
    return found


def raw_rows(n: int, seed: int, task: str = "classification") -> pd.DataFrame:
    """Raw rows as a user would score them: nulls in a numeric and a categorical column, categories
    the model never saw, an array column; ``id`` is the key kept beside the predictions."""
    frame = raw_frame(n, seed, task, SHAPE).drop(columns=["label"])
    frame.loc[frame.index[5::11], "city"] = "atlantis"  # unseen in training
    frame.insert(0, "id", np.arange(n, dtype=np.int64))
    assert frame["x2"].isna().any() and frame["city"].isna().any() and (frame["city"] == "atlantis").any()
    return frame


def write_parquet(frame: pd.DataFrame, path) -> str:
    os.makedirs(path, exist_ok=True)
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), os.path.join(path, "part-0.parquet"))
    return str(path)


@pytest.mark.stack
def test_scores_equal_load_model_predict(spark, models, tmp_path):
    frame = raw_rows(300, seed=7)
    df = spark.read.parquet(write_parquet(frame, tmp_path / "raw"))
    expected = load_model(models["classification"]).predict(frame)
    # batch_size 7: many forward passes per Arrow batch, and a short last one.
    got = predict_frame(df, models["classification"], keep_columns=["id"], batch_size=7).toPandas()
    assert list(got.columns) == ["id", "probabilities", "prediction", "score_reason"]
    got = got.sort_values("id").reset_index(drop=True)
    assert got["id"].tolist() == frame["id"].tolist() and got["score_reason"].isna().all()
    probs = np.stack(got["probabilities"].to_numpy()).astype(np.float32)
    np.testing.assert_allclose(probs, expected, rtol=0, atol=1e-6)
    assert (got["prediction"].to_numpy() == expected.argmax(axis=1)).all()
    assert len(set(got["prediction"])) == 2  # the model is not constant, so agreement means something

    # The TorchScript program, at a temperature (a teacher's soft targets): the same agreement.
    program = load_model(models["classification"], program=True)
    soft = predict_frame(df, models["classification"], keep_columns=["id"], temperature=2.5, program=True)
    soft = soft.toPandas().sort_values("id")
    np.testing.assert_allclose(np.stack(soft["probabilities"].to_numpy()), program.predict(frame, temperature=2.5),
                               rtol=0, atol=1e-6)


@pytest.mark.stack
def test_regression_scores_equal_load_model_predict(spark, models, tmp_path):
    frame = raw_rows(200, seed=8, task="regression")
    df = spark.read.parquet(write_parquet(frame, tmp_path / "raw"))
    got = predict_frame(df, models["regression"], keep_columns=["id"]).toPandas().sort_values("id")
    assert list(got.columns) == ["id", "prediction", "score_reason"]
    expected = load_model(models["regression"]).predict(frame)
    np.testing.assert_allclose(got["prediction"].to_numpy(np.float32), expected, rtol=1e-6, atol=1e-6)
    assert np.std(expected) > 0.1


@pytest.mark.stack
def test_temperature_divides_the_logits(models):
    """softmax(logits / T): every log-odds is the T = 1 log-odds divided by T; T = 1 is predict itself."""
    model = load_model(models["classification"])
    frame = raw_rows(50, seed=9)
    plain = model.predict(frame)
    np.testing.assert_array_equal(model.predict(frame, temperature=1.0), plain)
    soft = model.predict(frame, temperature=4.0)
    np.testing.assert_allclose(np.log(soft[:, 1] / soft[:, 0]), np.log(plain[:, 1] / plain[:, 0]) / 4.0,
                               rtol=1e-4, atol=1e-5)
    assert np.abs(soft - 0.5).max() < np.abs(plain - 0.5).max()  # softer
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        model.predict(frame, temperature=0)


@pytest.mark.stack
def test_values_the_model_cannot_take_are_quarantined_with_the_column(spark, models):
    """A string that is not a number, inf, an array of another length, with a NaN or null element,
    or no array: one reason each, naming the column, null predictions; the good rows still agree."""
    ok = [0.5, -1.0, 2.0, 0.25]
    rows = [  # id, x1 (a string column), x2, city, image
        (0, "1.5", 5.0, "paris", ok),
        (1, "abc", 5.0, "paris", ok),
        (2, "0.5", float("inf"), "lyon", ok),
        (3, "0.5", 4.0, "lyon", [1.0, 2.0, 3.0]),
        (4, "0.5", 4.0, "nice", [1.0, float("nan"), 3.0, 4.0]),
        (5, "0.5", 4.0, "nice", [1.0, None, 3.0, 4.0]),
        (6, "0.5", 4.0, None, None),
        (7, None, None, "atlantis", ok),
    ]
    df = spark.createDataFrame(rows, "id BIGINT, x1 STRING, x2 DOUBLE, city STRING, image ARRAY<DOUBLE>")
    got = predict_frame(df, models["classification"], keep_columns=["id"]).toPandas().set_index("id").sort_index()
    reasons = {i: (None if pd.isna(r) else r) for i, r in got["score_reason"].items()}  # pandas 3: NaN for null
    assert reasons == {
        0: None, 1: "bad_value:x1", 2: "non_finite:x2", 3: "bad_shape:image", 4: "non_finite:image",
        5: "non_finite:image", 6: "bad_shape:image", 7: None}
    bad = got["score_reason"].notna()
    assert got.loc[bad, "probabilities"].isna().all() and got.loc[bad, "prediction"].isna().all()
    good = pd.DataFrame({"x1": [1.5, None], "x2": [5.0, None], "city": ["paris", "atlantis"], "image": [ok, ok]})
    expected = load_model(models["classification"]).predict(good)
    np.testing.assert_allclose(np.stack(got.loc[[0, 7], "probabilities"].to_numpy()), expected, rtol=0, atol=1e-6)


def reasons_of(frame: pd.DataFrame) -> dict:
    """Row -> its score_reason (None where it was scored; pandas 3 reads a null as NaN)."""
    return {i: (None if pd.isna(r) else r) for i, r in frame["score_reason"].items()}


@pytest.mark.stack
def test_load_model_predict_refuses_the_rows_score_refuses_with_the_same_reasons(spark, models):
    """One set of row rules: rows in pandas through ``load_model(uri).predict(errors="mark")`` get
    the reasons ``score`` gives the same rows in Spark, the text rule first (U+FFFD is what Spark
    reads a byte that is not UTF-8 as), then each feature's (1e300, inf, a category one byte over
    the limit, arrays of another length or with a null element), and no prediction; the taken
    rows' probabilities are score's. Before, predict computed a number for every one of them."""
    from common.rows import MAX_CATEGORY_BYTES

    ok = [0.5, -1.0, 2.0, 0.25]
    longest = "x" * MAX_CATEGORY_BYTES  # the test dataset records no limit: the shard job's ceiling applies
    rows = [  # id, x1 (a string column), x2, city, image
        (0, "1.5", 5.0, "paris", ok),
        (1, "1e300", 5.0, "paris", ok),
        (2, "0.5", float("inf"), "lyon", ok),
        (3, "abc", 4.0, "k\ufffdln", ok),  # two rules broken: the text rule is the first
        (4, "0.5", 4.0, longest + "x", ok),
        (5, "0.5", 4.0, longest, ok),
        (6, "0.5", 4.0, "nice", [1.0, 2.0, 3.0]),
        (7, "0.5", 4.0, "nice", [1.0, None, 3.0, 4.0]),
        (8, None, None, None, ok),
    ]
    df = spark.createDataFrame(rows, "id BIGINT, x1 STRING, x2 DOUBLE, city STRING, image ARRAY<DOUBLE>")
    scored = predict_frame(df, models["classification"], keep_columns=["id"]).toPandas().set_index("id").sort_index()
    frame = pd.DataFrame(rows, columns=["id", "x1", "x2", "city", "image"]).set_index("id")
    marked = load_model(models["classification"]).predict(frame, errors="mark")
    expected = {0: None, 1: "non_finite:x1", 2: "non_finite:x2", 3: "bad_encoding", 4: "too_long:city", 5: None,
                6: "bad_shape:image", 7: "non_finite:image", 8: None}
    assert reasons_of(scored) == expected
    assert reasons_of(marked) == expected
    taken, refused = [0, 5, 8], [1, 2, 3, 4, 6, 7]
    assert marked.loc[refused, "probabilities"].isna().all()
    np.testing.assert_allclose(np.stack(marked.loc[taken, "probabilities"].to_numpy()),
                               np.stack(scored.loc[taken, "probabilities"].to_numpy()), rtol=0, atol=1e-6)


@pytest.mark.stack
def test_load_model_predict_raises_naming_the_row_or_marks_it_and_takes_an_empty_frame(models):
    """1e300 gave probabilities [nan, nan] with a RuntimeWarning; inf was imputed as a null; a
    10-million-character category and text that is not UTF-8 were scored as unseen categories.
    Now predict raises InputDataError (exit 2) naming the first such row by its index label, its
    column and reason; errors="mark" scores the others as before and marks these; an empty frame
    (pandas or Arrow) gives an empty result of the right shape (was: cannot reshape 0 elements)."""
    frame = raw_rows(12, seed=21).set_index(pd.Index([f"r{i}" for i in range(12)]))  # labels, not positions
    model = load_model(models["classification"])
    plain = model.predict(frame)
    bad = frame.astype({"x1": object, "city": object})
    bad.loc["r3", "x1"] = 1e300
    bad.loc["r5", "x2"] = np.inf
    bad.loc["r7", "city"] = "x" * 10_000_000
    bad.loc["r8", "city"] = "k\xf6ln".encode("latin-1")  # bytes that are not UTF-8
    bad.loc["r9", "city"] = b"k\xf6ln".decode("utf-8", "surrogateescape")  # what Python leaves of them in a str
    with pytest.raises(InputDataError, match=r"^row 'r3', column 'x1' \(value 1e\+300\): non_finite:x1 \(.*\); "
                                             r"5 of 12 rows cannot be taken") as err:
        model.predict(bad)
    assert err.value.exit_code == 2
    marked = model.predict(bad, errors="mark")
    assert list(marked.columns) == ["probabilities", "score_reason"] and list(marked.index) == list(frame.index)
    assert {i: r for i, r in reasons_of(marked).items() if r} == {
        "r3": "non_finite:x1", "r5": "non_finite:x2", "r7": "too_long:city", "r8": "bad_encoding", "r9": "bad_encoding"}
    taken = marked["score_reason"].isna().to_numpy()
    np.testing.assert_allclose(np.stack(marked["probabilities"][taken].to_numpy()), plain[taken], rtol=0, atol=1e-6)

    regression = load_model(models["regression"])
    values = regression.predict(bad, errors="mark")
    assert list(values.columns) == ["prediction", "score_reason"] and values["prediction"].dtype == np.float32
    assert values["prediction"].isna().to_numpy().tolist() == (~taken).tolist()
    table = pa.Table.from_pandas(frame, preserve_index=False)
    for loaded, shape in ((model, (0, 2)), (regression, (0,))):
        for empty in (frame.iloc[0:0], table.slice(0, 0)):
            assert loaded.predict(empty).shape == shape
            assert len(loaded.predict(empty, errors="mark")) == 0
    # An Arrow table's NaN is a value (pandas writes a missing value as NaN; Arrow and Spark as a null).
    x1 = table.column("x1").to_pylist()
    x1[4] = float("nan")
    table = table.set_column(table.schema.get_field_index("x1"), "x1", pa.array(x1, pa.float64(), from_pandas=False))
    assert reasons_of(model.predict(table, errors="mark"))[4] == "non_finite:x1"


@pytest.mark.stack
def test_missing_feature_or_uncastable_type_fails_before_any_work(spark, models):
    df = spark.createDataFrame([(1, 0.5, "paris")], "id BIGINT, x1 DOUBLE, city STRING")
    with pytest.raises(InputDataError, match=r"lacks the model's feature column 'x2' \(a number\)"):
        predict_frame(df, models["classification"])
    df = spark.createDataFrame([(1, 0.5, 1.0, "paris", "oops")], "id BIGINT, x1 DOUBLE, x2 DOUBLE, city STRING, image STRING")
    with pytest.raises(InputDataError, match="column 'image' has type string, which the model's preprocessing cannot"):
        predict_frame(df, models["classification"])
    df = spark.createDataFrame([(1, 0.5, 1.0, "paris", [1.0])], "id BIGINT, x1 DOUBLE, x2 DOUBLE, city STRING, image ARRAY<DOUBLE>")
    with pytest.raises(InputDataError, match=r"output.keep_columns names column\(s\) \['user'\]"):
        predict_frame(df, models["classification"], keep_columns=["user"])


# --- the score job: output, accounting, modes, exit status ---------------------------------------

def bad_source(tmp_path) -> tuple[str, pd.DataFrame, dict]:
    """Raw Parquet with 200 good rows and 4 the model cannot take (with their expected reasons)."""
    frame = raw_rows(204, seed=11)
    frame["image"] = [np.asarray(v, dtype=np.float32) for v in frame["image"]]
    reasons = {200: "non_finite:x1", 201: "bad_shape:image", 202: "bad_shape:image", 203: "non_finite:image"}
    frame.loc[200, "x1"] = np.inf
    frame.at[201, "image"] = np.ones(3, dtype=np.float32)
    frame.at[202, "image"] = None
    frame.at[203, "image"] = np.array([1, np.nan, 0, 0], dtype=np.float32)
    return write_parquet(frame, tmp_path / "raw"), frame, reasons


def score_config(path, model: str, source: str, output: str, **extra) -> str:
    cfg = {"model": model, "sources": {"raw": {"path": source}}, "output": {"path": output, "keep_columns": ["id"]},
           "batch_size": 64, **extra}
    with open(path, "w") as fh:
        yaml.safe_dump(cfg, fh)
    return str(path)


def cli(*args) -> int:
    from shardtrain.cli import main

    return main(list(args))  # in-process: the active (test) Spark session is the job's


@pytest.mark.stack
def test_score_job_publishes_scores_and_quarantine_and_keeps_the_modes(spark, models, tmp_path, capsys):
    source, frame, reasons = bad_source(tmp_path)
    out = tmp_path / "scores"
    config = score_config(tmp_path / "score.yaml", models["classification"], source, str(out))
    assert cli("score", "--config", config) == 0
    marker = json.loads((out / MARKER).read_text())
    assert marker["kind"] == "shardtrain.scores"

    scored = pd.read_parquet(out, engine="pyarrow").sort_values("id")  # the root's part files (_quarantine is skipped)
    assert list(scored.columns) == ["id", "probabilities", "prediction"]
    quarantine = pd.read_parquet(out / "_quarantine")
    quarantined = {json.loads(raw)["id"]: reason for raw, reason in zip(quarantine["raw"], quarantine["reason"])}
    assert quarantined == reasons
    assert sorted([*scored["id"], *quarantined]) == list(range(len(frame)))  # rows in = scored + quarantined
    clean = frame[~frame["id"].isin(reasons)]
    np.testing.assert_allclose(np.stack(scored["probabilities"].to_numpy()),
                               load_model(models["classification"]).predict(clean), rtol=0, atol=1e-6)
    summary = json.loads((out / "_scores.json").read_text())
    assert summary["accounting"] == {"input_rows": 204, "scored_rows": 200, "quarantined_rows": 4}
    assert summary["quarantine"]["by_reason"] == {"bad_shape:image": 2, "non_finite:image": 1, "non_finite:x1": 1}

    before = (out / MARKER).read_bytes()
    capsys.readouterr()
    assert cli("score", "--config", config) == 2  # mode: error (the default)
    assert f"{out} already exists; set output.mode=overwrite" in capsys.readouterr().err
    assert cli("score", "--config", config, "output.mode=skip_if_exists") == 0
    assert "unchanged, skipped" in capsys.readouterr().out
    assert (out / MARKER).read_bytes() == before  # nothing was rewritten
    assert cli("score", "--config", config, "output.mode=skip_if_exists", "temperature=2.0") == 2
    assert "holds other scores" in capsys.readouterr().err
    assert (out / MARKER).read_bytes() == before

    assert cli("score", "--config", config, "output.mode=overwrite", "batch_size=5") == 0
    assert (out / MARKER).read_bytes() != before
    assert len(pd.read_parquet(out, engine="pyarrow")) == 200

    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("keep me")
    assert cli("score", "--config", config, f"output.path={theirs}", "output.mode=overwrite") == 2
    assert "holds 1 entry that shardtrain did not publish (notes.txt)" in capsys.readouterr().err
    assert (theirs / "notes.txt").read_text() == "keep me"
    other_model = tmp_path / "other-model"
    shutil.copytree(models["regression"], other_model)
    assert cli("score", "--config", config, f"output.path={other_model}", "output.mode=overwrite") == 2
    assert "holds a shardtrain.model, not a shardtrain.scores" in capsys.readouterr().err
    assert load_model(str(other_model)).task == "regression"  # untouched
    assert cli("score", "--config", config, f"output.path={source}/scores") == 2
    assert "is inside source 'raw' (sources.raw.path)" in capsys.readouterr().err
    assert not os.path.exists(f"{source}/scores")


def test_score_job_onto_a_full_disk_names_the_output_and_leaves_nothing(spark, models, tmp_path, small_disk, capsys):
    """A real tmpfs with room for the writer lock but not the scores: one line naming the output
    (not the model, as the error used to), exit 1, and nothing left on that disk."""
    frame = raw_rows(3000, seed=13)
    frame["image"] = [np.asarray(v, dtype=np.float32) for v in frame["image"]]
    source = write_parquet(frame, tmp_path / "raw")
    out = small_disk.path / "scores"
    config = score_config(tmp_path / "score.yaml", models["classification"], source, str(out))
    small_disk.fill(leave_bytes=2 * 4096)
    assert cli("score", "--config", config) == 1
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("shardtrain: error:")]
    assert line.startswith(f"shardtrain: error: writing the scores to {out} (model {models['classification']}) "
                           "failed: ") and "No space left on device" in line, line
    assert os.listdir(small_disk.path) == ["filler"]


@pytest.mark.stack
def test_executors_whose_python_lacks_shardtrain_are_one_line_saying_what_to_install(
        spark, models, tmp_path, executors_without_shardtrain, capsys):
    """Executors whose Python has no shardtrain (a cluster, or a local Spark Connect server, without
    PYSPARK_PYTHON pointing at the right environment) fail every task unpickling the job's code:
    one line saying what to install or set, exit 2 (a retry fails the same way), no traceback."""
    # The workers' Python really lacks shardtrain, and has everything else they need.
    probe = subprocess.run([executors_without_shardtrain, "-c", "import pyarrow, pandas, pyspark, torch, scoring"],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert probe.stderr.strip().endswith("ModuleNotFoundError: No module named 'scoring'"), probe.stderr
    source, _, _ = bad_source(tmp_path)
    out = tmp_path / "scores"
    config = score_config(tmp_path / "score.yaml", models["classification"], source, str(out))
    assert cli("score", "--config", config) == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("shardtrain: error:")]
    assert line.startswith(f"shardtrain: error: writing the scores to {out} (model {models['classification']}) failed: "
                           "the executors' Python cannot import shardtrain (No module named "), line
    assert line.endswith(f": {EXECUTOR_SHARDTRAIN_FIX}") and "`make wheel`" in line and "PYSPARK_PYTHON" in line, line
    assert "Traceback" not in err
    assert not (out / MARKER).exists()


@pytest.mark.stack
def test_score_job_refuses_a_missing_or_uncastable_feature_in_one_line(spark, models, tmp_path, capsys):
    """The job checks every feature against the input's schema before it builds any SQL from them:
    a missing numeric or array feature, a timestamp where a number is wanted: exit 2, one line
    naming the column, the type found and the type wanted; no output."""
    frame = raw_rows(20, seed=12)
    cases = {"no-x2": (frame.drop(columns=["x2"]), "the input lacks the model's feature column 'x2' (a number)"),
             "no-image": (frame.drop(columns=["image"]),
                          "the input lacks the model's feature column 'image' (array<float>)"),
             "timestamp-x2": (frame.assign(x2=pd.Timestamp("2026-01-01")),
                              # timestamp_ntz on Spark >= 3.4 (the file's timestamps have no time zone)
                              "column 'x2' has type timestamp")}
    for name, (rows, message) in cases.items():
        table = pa.Table.from_pandas(rows, preserve_index=False)
        if name == "timestamp-x2":
            table = table.set_column(table.schema.get_field_index("x2"), "x2", table.column("x2").cast(pa.timestamp("us")))
        os.makedirs(tmp_path / name)
        pq.write_table(table, tmp_path / name / "part-0.parquet")
        assert spark.read.parquet(str(tmp_path / name)).schema  # the source is readable: only the feature is wrong
        out = tmp_path / f"scores-{name}"
        config = score_config(tmp_path / f"{name}.yaml", models["classification"], str(tmp_path / name), str(out))
        capsys.readouterr()
        assert cli("score", "--config", config) == 2, name
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("shardtrain: error:")]
        assert len(errors) == 1 and message in errors[0], err
        if name == "timestamp-x2":
            assert "which the model's preprocessing cannot take as a number" in errors[0], err
        assert "Traceback" not in err and not out.exists()


@pytest.mark.stack
def test_score_job_quarantines_values_float32_cannot_hold(spark, models, tmp_path, capsys):
    """1e300 was scored as probabilities [nan, nan], prediction 0, and counted as scored. Now a
    numeric value that is NaN, infinite or beyond float32 is quarantined as non_finite:<col>,
    like the shard job does; a valid neighbour (3e38, which float32 holds) is scored; the
    accounting adds up."""
    frame = raw_rows(30, seed=13)
    bad = {3: ("x1", 1e300), 4: ("x2", -1e300), 5: ("x1", float("nan"))}
    for row, (column, value) in bad.items():
        frame.loc[row, column] = value
    frame.loc[6, "x1"] = 3.0e38
    table = pa.Table.from_pandas(frame, preserve_index=False)
    # from_pandas would make NaN a null (imputed): write it as the NaN a Spark job or a file can hold.
    x1 = table.column("x1").to_pylist()
    x1[5] = float("nan")
    table = table.set_column(table.schema.get_field_index("x1"), "x1", pa.array(x1, pa.float64(), from_pandas=False))
    os.makedirs(tmp_path / "raw")
    pq.write_table(table, tmp_path / "raw" / "part-0.parquet")
    assert np.isnan(pq.read_table(tmp_path / "raw").column("x1").to_numpy()[5])  # a NaN, not a null
    out = tmp_path / "scores"
    config = score_config(tmp_path / "score.yaml", models["classification"], str(tmp_path / "raw"), str(out))
    assert cli("score", "--config", config) == 0, capsys.readouterr().err
    scored = pd.read_parquet(out, engine="pyarrow")
    assert sorted(scored["id"]) == [i for i in range(30) if i not in bad]
    assert np.isfinite(np.stack(scored["probabilities"].to_numpy())).all()
    quarantine = pd.read_parquet(out / "_quarantine")
    assert {json.loads(raw)["id"]: reason for raw, reason in zip(quarantine["raw"], quarantine["reason"])} == {
        3: "non_finite:x1", 4: "non_finite:x2", 5: "non_finite:x1"}
    summary = json.loads((out / "_scores.json").read_text())
    assert summary["accounting"] == {"input_rows": 30, "scored_rows": 27, "quarantined_rows": 3}
    assert summary["quarantine"]["by_reason"] == {"non_finite:x1": 2, "non_finite:x2": 1}


def emptied_column_source(tmp_path, rows: int = 60) -> tuple[str, pd.DataFrame]:
    """Raw Parquet whose numeric feature x1 is null in every row (a double column of nulls, as an
    upstream schema change leaves it); the other columns as usual."""
    frame = raw_rows(rows, seed=14)
    table = pa.Table.from_pandas(frame, preserve_index=False)
    table = table.set_column(table.schema.get_field_index("x1"), "x1", pa.nulls(rows, pa.float64()))
    os.makedirs(tmp_path / "emptied")
    pq.write_table(table, tmp_path / "emptied" / "part-0.parquet")
    return str(tmp_path / "emptied"), frame


@pytest.mark.stack
def test_a_feature_column_the_input_left_null_is_warned_about_then_refused_past_fail_null_increase(
        spark, models, tmp_path, capsys, caplog):
    """Training/serving skew: x1 is null in every input row (in no train row). With the
    default quality settings the job scores (exit 0: the values are imputed) but warns, naming x1
    with both shares, and records both in _scores.json; with quality.fail_null_increase=0.3 it is
    exit 2, one line naming x1, and nothing is published."""
    caplog.set_level("INFO", logger="shardtrain")
    model = load_model(models["classification"])
    train = model.features.null_shares
    assert train == read_manifest(models["classification-dataset"].uri).features.null_shares  # model.json carries them
    assert train["x1"] == 0.0 and set(train) == {"x1", "x2", "city", "image"}
    source, frame = emptied_column_source(tmp_path)
    assert spark.read.parquet(source).where("x1 IS NOT NULL").count() == 0  # Spark reads x1 as all null

    out = tmp_path / "scores"
    config = score_config(tmp_path / "score.yaml", models["classification"], source, str(out))
    assert cli("score", "--config", config) == 0, capsys.readouterr().err
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "past quality.max_null_increase (0.5) for column 'x1' (100.0% of the input rows " \
        "null, 0.0% on train)" in warnings[0], warnings
    shares = json.loads((out / "_scores.json").read_text())["null_share"]
    expected = {"x1": 1.0, "x2": frame["x2"].isna().mean(), "city": frame["city"].isna().mean(), "image": 0.0}
    assert shares == {"train": train, "input": expected, "past_max_null_increase": ["x1"]}

    capsys.readouterr()
    refused = tmp_path / "refused"
    assert cli("score", "--config", config, f"output.path={refused}", "quality.fail_null_increase=0.3") == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("shardtrain: error:")]
    assert "past quality.fail_null_increase (0.3) for column 'x1' (100.0% of the input rows null, 0.0% on train); " \
        "nothing was published" in line, err
    assert "'x2'" not in line and "Traceback" not in err
    assert not [p.name for p in tmp_path.iterdir() if "refused" in p.name]  # no output, staging or lock left


PUBLISHED_BEFORE = os.path.join(ROOT, "tests", "training", "fixtures", "published_before", "model")


@pytest.mark.stack
def test_a_model_whose_dataset_recorded_no_null_shares_skips_the_check_saying_so_once(spark, tmp_path, caplog):
    """A model published before null shares were recorded (tests/training/fixtures) scores an input
    with an emptied column as before (exit 0, no warning), and says once why the check is skipped."""
    caplog.set_level("INFO", logger="shardtrain")
    assert load_model(PUBLISHED_BEFORE).features.null_shares == {}  # none recorded
    source, _ = emptied_column_source(tmp_path)
    out = tmp_path / "scores"
    assert cli("score", "--config", score_config(tmp_path / "score.yaml", PUBLISHED_BEFORE, source, str(out))) == 0
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("shardtrain")]
    assert sum("null shares are not compared" in m for m in messages) == 1, messages
    assert "the model records none" in next(m for m in messages if "null shares are not compared" in m)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    shares = json.loads((out / "_scores.json").read_text())["null_share"]
    assert shares["train"] is None and shares["input"]["x1"] == 1.0 and shares["past_max_null_increase"] == []


# sha256 of the score job's text files (marker, _scores.json, _config.yaml, _SUCCESS), normalized as
# output_digests does, as main's code at 2b8cdf9 (a count pass, the scores, then the quarantine
# re-reading the input) wrote them on this test's inputs. Parquet files are compared in-session
# instead: Spark's Parquet writer lists a column's encodings in a JVM hash set's order, so the same
# rows give other bytes in another JVM (seen: main's own output differs from run to run).
# Regenerate with SHARDTRAIN_WRITE_SCORE_DIGESTS=1 only from code whose outputs are known right.
SCORE_DIGESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "score_output_sha256.json")


def output_digests(out, *roots) -> dict[str, str]:
    """{file: sha256} of everything under ``out``: a part file's random id replaced by ``*``; in the
    JSON/YAML files the temporary paths replaced and what comes from the clock, the files' modification
    times or the model.json (which holds its temporary paths) left out: ``committed_at``, the input
    fingerprint and its file records, ``model_json_sha256``."""
    import hashlib
    import re

    digests = {}
    for path in sorted(out.rglob("*")):
        if path.is_dir():
            continue
        name = re.sub(r"-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}-", "-*-", str(path.relative_to(out)))
        data = path.read_bytes()
        if path.suffix in (".json", ".yaml") or path.name == MARKER:
            text = data.decode()
            for i, root in enumerate(roots):
                text = text.replace(str(root), f"<root{i}>")
            if path.suffix != ".yaml":
                record = json.loads(text)
                for volatile in ("committed_at", "input_fingerprint", "input", "model_json_sha256"):
                    record.pop(volatile, None)
                text = json.dumps(record, sort_keys=True)
            data = text.encode()
        digests[name] = hashlib.sha256(data).hexdigest()
    return digests


def previous_job_writes(spark, config: str, out) -> None:
    """What the job wrote before, in the order it wrote it, into ``out``: every row typed and given
    its reason, the clean ones scored into the root, then the quarantine from another pass over the
    input (written even when it holds no rows)."""
    from scoring.config import load_score_config
    from scoring.job import _quarantine_rows
    from scoring.predict import reason_sql

    cfg = load_score_config(config, [])
    table = spark.read.parquet(cfg.sources["raw"].path)
    fields = {f.name: f.dataType for f in table.schema.fields}
    checked = table.selectExpr("*", f"{reason_sql(fields, load_model(cfg.model).features)} AS score_reason")
    scored = predict_frame(checked.where("score_reason IS NULL"), cfg.model, batch_size=cfg.batch_size,
                           keep_columns=cfg.output.keep_columns).drop("score_reason")
    scored.write.parquet(str(out))
    _quarantine_rows(cfg, checked, table.columns, []).write.parquet(str(out / "_quarantine"))


@pytest.mark.stack
def test_score_job_writes_the_same_bytes_as_before(spark, models, tmp_path, capsys):
    """Every output file equal, byte for byte, to what the job wrote before it counted reasons in
    the scoring pass and skipped the quarantine's pass over the input when there are no bad rows:
    raw rows in two files with bad rows only in the second, and the same rows without the bad ones
    (no quarantine pass now: its one empty file comes from no rows). Parquet files against the
    previous passes run in this session; the text files against digests of main's output."""
    import pyspark

    frame = bad_source(tmp_path)[1]
    outputs = {}
    for case, rows in (("bad_rows", frame), ("clean", frame.iloc[:200])):
        source = tmp_path / f"raw-{case}"
        write_parquet(rows.iloc[:100], source)
        pq.write_table(pa.Table.from_pandas(rows.iloc[100:], preserve_index=False), source / "part-1.parquet")
        out = tmp_path / f"scores-{case}"
        config = score_config(tmp_path / f"{case}.yaml", models["classification"], str(source), str(out))
        assert cli("score", "--config", config) == 0, capsys.readouterr().err
        outputs[case] = output_digests(out, tmp_path, os.path.dirname(models["classification"]))
        previous_job_writes(spark, config, tmp_path / f"previous-{case}")
        before = output_digests(tmp_path / f"previous-{case}")
        parquet = {name: digest for name, digest in outputs[case].items() if ".parquet" in name}
        assert parquet and parquet == {name: digest for name, digest in before.items() if ".parquet" in name}
    assert sum(1 for name in outputs["clean"] if name.startswith("_quarantine/part-")) == 1
    text = {case: {n: d for n, d in digests.items() if ".parquet" not in n} for case, digests in outputs.items()}
    known = json.load(open(SCORE_DIGESTS)) if os.path.exists(SCORE_DIGESTS) else {}
    if os.environ.get("SHARDTRAIN_WRITE_SCORE_DIGESTS") == "1":
        known[pyspark.__version__] = text
        with open(SCORE_DIGESTS, "w") as fh:
            json.dump(known, fh, indent=1, sort_keys=True)
            fh.write("\n")
        pytest.skip(f"wrote the digests of Spark {pyspark.__version__} to {SCORE_DIGESTS}")
    if pyspark.__version__ not in known:
        pytest.skip(f"no recorded digests for Spark {pyspark.__version__} (its _SUCCESS/.crc files may differ)")
    expected = known[pyspark.__version__]
    differ = sorted(f"{case}/{name}" for case in expected for name in {*expected[case], *text[case]}
                    if expected[case].get(name) != text[case].get(name))
    assert not differ, f"files that differ from before (or are new or missing): {differ}"

def test_reason_values_are_every_reason_the_sql_gives():
    """The job counts rows by the reasons read off reason_sql's own branches: every one of them,
    in order, for names that hold a quote, a backslash and the words the branches are built of."""
    from pyspark.sql import types as T

    from common.features import FeatureSpec
    from scoring.predict import reason_sql, reason_values

    odd = "x THEN 'y\\' END"
    stats = {"mean": 0.0, "std": 1.0, "fill": 0.0}
    spec = FeatureSpec({"numeric": [{"name": odd, **stats}, {"name": "n", **stats}],
                        "categorical": [{"name": "c", "vocab": ["p", "q", "r"]}],  # 5 embeddings
                        "arrays": [{"name": "a'", "shape": [2]}]}, max_category_bytes=1024)
    fields = {odd: T.StringType(), "n": T.DoubleType(), "c": T.IntegerType(), "a'": T.ArrayType(T.FloatType())}
    assert reason_values(fields, spec) == ["bad_encoding", f"bad_value:{odd}", f"non_finite:{odd}", "non_finite:n",
                                           "too_long:c", "bad_shape:a'", "non_finite:a'"]
    assert reason_values(fields, spec, encoded=True) == [f"bad_value:{odd}", f"non_finite:{odd}", "bad_value:n",
                                                         "non_finite:n", "bad_value:c", "bad_shape:a'", "non_finite:a'"]
    from common.sql import quote_string

    sql = reason_sql(fields, spec, encoded=True)
    assert all(f"THEN {quote_string(value)}" in sql for value in reason_values(fields, spec, encoded=True))

@pytest.mark.stack
def test_score_job_refuses_a_model_json_that_disagrees_with_the_network(spark, models, tmp_path, capsys):
    """model.json edited consistently (its digest re-recorded in the marker): num_classes 1 was
    published as 1-element probabilities with exit 0, num_classes 3 and task regression gave
    tracebacks. Each is one line naming the field, exit 2, and nothing is written."""
    import hashlib

    source, _, _ = bad_source(tmp_path)
    for field, value in (("num_classes", 1), ("num_classes", 3), ("task", "regression")):
        model = tmp_path / f"model-{field}-{value}"
        shutil.copytree(models["classification"], model)
        meta = json.loads((model / "model.json").read_text())
        meta["label"][field] = value
        text = json.dumps(meta)
        (model / "model.json").write_text(text)
        marker = json.loads((model / MARKER).read_text())
        marker["model_json_sha256"] = hashlib.sha256(text.encode()).hexdigest()
        (model / MARKER).write_text(json.dumps(marker))
        out = tmp_path / f"scores-{field}-{value}"
        config = score_config(tmp_path / "score.yaml", str(model), source, str(out))
        capsys.readouterr()
        assert cli("score", "--config", config) == 2
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("shardtrain: error:")]
        assert len(errors) == 1 and f"{model}/model.json: field 'label.{field}' is {value!r}" in errors[0], err
        assert "Traceback" not in err and not out.exists()


@pytest.mark.stack
def test_score_job_on_a_dataset_split_uses_its_stored_encodings(spark, models, tmp_path, capsys):
    ds = models["classification-dataset"]
    out = tmp_path / "val-scores"
    config = tmp_path / "score.yaml"
    config.write_text(yaml.safe_dump({"model": models["classification"], "dataset": ds.uri, "split": "val",
                                      "output": {"path": str(out), "keep_columns": ["_row", "label"]}}))
    assert cli("score", "--config", str(config)) == 0
    got = pd.read_parquet(out, engine="pyarrow").sort_values("_row")
    assert got["_row"].tolist() == list(range(len(ds.raw["val"])))
    expected = load_model(models["classification"]).predict(ds.raw["val"])  # from the raw rows
    np.testing.assert_allclose(np.stack(got["probabilities"].to_numpy()), expected, rtol=0, atol=1e-6)

    # The same encodings in a manifest written before null shares were recorded: the same rows to the model.
    before = tmp_path / "before"
    shutil.copytree(ds.uri, before)
    manifest = json.loads((before / "_manifest.json").read_text())
    for record in manifest["features"]:
        del record["null_share"]
    (before / "_manifest.json").write_text(json.dumps(manifest))
    assert not read_manifest(str(before)).features.null_shares
    assert cli("score", "--config", str(config), f"dataset={before}", f"output.path={tmp_path}/b") == 0
    again = pd.read_parquet(tmp_path / "b", engine="pyarrow").sort_values("_row")
    np.testing.assert_array_equal(np.stack(again["probabilities"].to_numpy()), np.stack(got["probabilities"].to_numpy()))

    # Another dataset's encodings (its own statistics and vocabulary) mean something else to the model.
    other = write_dataset(str(tmp_path / "other"), {"train": [[90]], "val": [[30]]}, seed=5, array_shape=SHAPE)
    assert cli("score", "--config", str(config), f"dataset={other.uri}", f"output.path={tmp_path}/o") == 2
    assert "encodes its features differently from the model" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o")


@pytest.mark.process
def test_config_errors_exit_2_before_spark_starts(tmp_path):
    """The real command in its own process: one line naming the key, exit 2, no JVM started."""
    config = score_config(tmp_path / "score.yaml", "m", "raw", str(tmp_path / "out"))
    for extra, message in ((["batch_sise=8"], "unknown key 'batch_sise'; did you mean 'batch_size'?"),
                           ([f"dataset={tmp_path}"], "sources or dataset must be set (exactly one)"),
                           (["temperature=0"], "temperature must be a finite number > 0")):
        proc = subprocess.run([SHARDTRAIN, "score", "--config", config, *extra], capture_output=True, text=True,
                              timeout=120, cwd=ROOT)
        assert proc.returncode == 2, proc.stderr
        errors = [line for line in proc.stderr.splitlines() if line.startswith("shardtrain: error:")]
        assert len(errors) == 1 and message in errors[0], proc.stderr
        assert "Traceback" not in proc.stderr and "SparkContext" not in proc.stderr


@pytest.mark.process
def test_local_paths_are_refused_naming_the_key_where_spark_connect_runs_on_another_machine(tmp_path):
    """A Spark Connect server on another host reads through its cluster, where this machine's paths
    name nothing: the real command, in its own process, refuses the first local one, naming its key
    (made absolute), exit 2, before it connects to anything (the host does not even resolve)."""
    config = score_config(tmp_path / "score.yaml", "artifacts/model", "/Volumes/main/default/raw",
                          "/Volumes/main/default/scores")  # a volume: what a Databricks cluster reads
    remote = {**os.environ, "SPARK_REMOTE": "sc://spark-cluster.invalid:15002"}
    proc = subprocess.run([SHARDTRAIN, "score", "--config", config], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env=remote)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("shardtrain: error:")]
    assert errors == [f"shardtrain: error: model is {tmp_path}/artifacts/model, a path on this machine, but "
                      "this job's Spark runs on the Spark Connect server at spark-cluster.invalid, whose executors "
                      "cannot read this machine's files: give a URI the cluster can read (s3://, hdfs://, dbfs:/ or a "
                      "/Volumes/... path)"], proc.stderr


@pytest.mark.stack
def test_a_model_replaced_after_the_driver_checked_it_is_refused(spark, models, tmp_path):
    """Workers compare the weights digest with the driver's: they never mix two models' predictions."""
    from common.errors import SparkJobError
    from common.spark import spark_errors

    uri = str(tmp_path / "model")
    shutil.copytree(models["classification"], uri)
    df = spark.read.parquet(write_parquet(raw_rows(20, seed=3), tmp_path / "raw"))
    scored = predict_frame(df, uri, keep_columns=["id"])
    shutil.rmtree(uri)
    shutil.copytree(models["regression"], uri)  # a valid model, but another one
    with pytest.raises(SparkJobError, match="the model was replaced while this job ran"):
        with spark_errors("scoring"):
            scored.collect()


@pytest.mark.stack
def test_a_model_replaced_after_the_job_recorded_it_is_refused(spark, models, tmp_path):
    """The driver compares the model it loads with the fingerprint the job recorded first (the
    scores' marker, a dataset's teacher record): a model replaced at the URI in between is
    refused, so one model's outputs are never published under another's fingerprint."""
    from common.errors import DatasetError
    from common.publish import read_marker
    from shardtrain.teacher import describe_teacher, score_teacher

    uri = str(tmp_path / "model")
    shutil.copytree(models["classification"], uri)
    recorded = describe_teacher(uri)["fingerprint"]
    assert recorded == read_marker(uri)["model_json_sha256"] == load_model(uri).fingerprint
    df = spark.read.parquet(write_parquet(raw_rows(20, seed=4), tmp_path / "raw"))
    assert predict_frame(df, uri, keep_columns=["id"], fingerprint=recorded).count() == 20  # the same model: scored

    shutil.rmtree(uri)
    shutil.copytree(models["regression"], uri)  # a valid model, but another one
    assert read_marker(uri)["model_json_sha256"] != recorded  # the replacement really is another model
    with pytest.raises(DatasetError, match="the model was replaced while this job ran"):
        predict_frame(df, uri, keep_columns=["id"], fingerprint=recorded)
    with pytest.raises(DatasetError, match="the model was replaced while this job ran"):
        score_teacher(df, uri, 1.0, recorded)
