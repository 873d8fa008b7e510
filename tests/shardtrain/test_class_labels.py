"""Class labels that name their classes (``label.classes``), from the shard job to ``score``, on
real Spark (local[2]) and an in-process training: the class list is fitted on the train split
(most frequent first, ties by name), a val row of a class train never saw is quarantined
(``unknown_class``) as a null label is (``null_label``), the stored label is the class index, and
every output a user reads names the classes: ``load_model(...).predict``, ``score``'s
``prediction``, ``inspect``. A teacher whose classes are other names, or the same names in
another order, is refused (exit 2, naming both lists). The config's refusals name the keys.

Multilabel (``task: multilabel``): a list of classes per row, stored as a multi-hot vector; a null
class in a list is ``invalid_label``, a class train never saw ``unknown_class``; the run reports
micro and macro F1 against their baseline and each class's F1; ``predict`` and ``score`` give each
class's probability and the list of classes at or above ``label.threshold``."""

from __future__ import annotations

import os
import sys

import numpy as np
import pandas as pd
import pytest
import yaml

from common.errors import EXIT_USAGE, ConfigError, InputDataError

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pipelines"))
from shard_testdata import config, quarantine, read_split, write_parquet  # noqa: E402

pytestmark = pytest.mark.spark

FRACTIONS = {"train": 0.6, "val": 0.4}
CLASSES = ["dog", "ant", "cat"]  # dog the most frequent on train; ant and cat tie, so by name
SIGNAL = {"dog": 0.0, "ant": 3.0, "cat": 6.0, "zebra": 9.0, "yak": 1.0}


def _split_of(spark, ids: list[int]) -> dict[int, str]:
    """Where the shard job's split (split.key: id, seed 0) sends each id."""
    from pipelines.balance import split_index_sql

    sql = split_index_sql("CAST(id AS STRING)", 0, FRACTIONS)
    names = list(FRACTIONS)
    return {r["id"]: names[r["s"]] for r in spark.range(max(ids) + 1).selectExpr("id", f"{sql} AS s").collect()
            if r["id"] in ids}


def _raw_rows(spark) -> pd.DataFrame:
    """80 clean rows whose train rows are dog:ant:cat 2:1:1 (the rest dog), then a val row of class
    zebra (never in train), a train row of class yak whose x is inf, and a row without a label."""
    split = _split_of(spark, list(range(200)))
    train = [i for i in range(80) if split[i] == "train"]
    labels = {i: CLASSES[(i % 3)] for i in range(80) if split[i] == "val"}
    whole = 4 * (len(train) // 4)
    labels.update({i: ["dog", "dog", "ant", "cat"][k % 4] if k < whole else "dog" for k, i in enumerate(train)})
    zebra = next(i for i in range(80, 200) if split[i] == "val")
    yak = next(i for i in range(80, 200) if split[i] == "train" and i != zebra)
    unlabelled = next(i for i in range(80, 200) if i not in (zebra, yak))
    labels.update({zebra: "zebra", yak: "yak", unlabelled: None})
    ids = sorted(labels)
    rng = np.random.default_rng(0)
    x = [SIGNAL.get(labels[i], 0.0) + rng.normal(0, 0.3) for i in ids]
    x[ids.index(yak)] = float("inf")
    return pd.DataFrame({"id": ids, "x": x, "c": [f"k{i % 3}" for i in ids], "y": [labels[i] for i in ids]})


def _columns(frame: pd.DataFrame) -> dict:
    """The frame's columns as lists for Arrow, a missing label as None: pandas 3 lists a missing
    string as NaN, which Arrow will not take in a string column (the current profile's pandas)."""
    return {name: [None if not isinstance(v, (list, np.ndarray)) and pd.isna(v) else v for v in frame[name].tolist()]
            if frame[name].dtype.kind not in "fiub" else frame[name].tolist() for name in frame.columns}


def _shard_config(src, out, **label):
    return config(src, out, label={"column": "y", "num_classes": None, "classes": "auto", **label},
                  split={"key": "id", "fractions": FRACTIONS})


@pytest.fixture(scope="module")
def named(spark, tmp_path_factory):
    """The rows sharded with ``label.classes: auto``, and a model trained on them in-process."""
    from pipelines.shard_job import run_shard_job
    from train_configs import train_config
    from training import train

    root = tmp_path_factory.mktemp("class-labels")
    raw = _raw_rows(spark)
    src = write_parquet(root / "raw", _columns(raw))
    result = run_shard_job(spark, _shard_config(src, str(root / "ds")))
    model = train(train_config(result.uri, str(root / "model"), "train.epochs=6", "train.batch_size=16",
                               "train.lr=0.1", "model.hidden=[8]", "data.shuffle_buffer_rows=64")).model_uri
    return {"root": root, "raw": raw, "src": src, "dataset": result, "model": model}


@pytest.mark.stack  # the shard job's SQL and aggregation on each stack
def test_classes_are_fitted_on_train_and_other_classes_are_quarantined(named):
    manifest = named["dataset"].manifest
    assert manifest.label.classes == tuple(CLASSES) and manifest.label.num_classes == 3
    assert manifest.data["quarantine"]["by_reason"] == {"non_finite:x": 1, "null_label": 1, "unknown_class": 1}
    # Each row's label read back from its raw JSON, into a dict (pandas 3's map would turn None into NaN).
    rows = quarantine(manifest.root.path)
    quarantined = {reason: yaml.safe_load(raw).get("y") for reason, raw in zip(rows["reason"], rows["raw"])}
    assert quarantined == {"non_finite:x": "yak", "null_label": None, "unknown_class": "zebra"}
    for split in manifest.split_names:  # the stored label is the class's index
        assert read_split(manifest.root.path, split).schema.field("label").type == "int64"
    train = read_split(manifest.root.path, "train").column("label").to_numpy()
    counts = list(manifest.label.train_class_counts)
    assert counts == np.bincount(train, minlength=3).tolist() and counts[0] > counts[1] == counts[2]
    # The config recorded is the one given: auto stays auto (the manifest's label holds the list).
    recorded = yaml.safe_load(open(os.path.join(manifest.root.path, "config.yaml")))
    assert recorded["label"]["classes"] == "auto" and manifest.data["config"]["label"]["classes"] == "auto"

    from pipelines.describe import describe_dataset

    assert "3 classes; train class counts {'dog': " in describe_dataset(manifest.root.uri)


@pytest.mark.stack  # predict on each stack's pandas
def test_predict_and_score_give_the_class_names(named, spark):
    from scoring.predict import predict_frame
    from training import load_model

    raw = named["raw"].dropna(subset=["y"])
    clean = raw[np.isfinite(raw["x"])]
    model = load_model(named["model"])
    assert model.classes == CLASSES
    out = model.predict(clean[["x", "c"]])
    assert list(out.columns) == ["probabilities", "prediction"] and (out.index == clean.index).all()
    probabilities = np.stack(out["probabilities"].to_numpy())
    assert probabilities.shape == (len(clean), 3)
    assert out["prediction"].tolist() == [CLASSES[k] for k in probabilities.argmax(axis=1)]
    known = clean["y"].isin(CLASSES).to_numpy()
    assert (out["prediction"][known] == clean["y"][known]).mean() > 0.8  # it learnt the names, not their order
    marked = model.predict(raw[["x", "c"]], errors="mark")
    assert list(marked.columns) == ["probabilities", "prediction", "score_reason"]
    refused = ~np.isfinite(raw["x"].to_numpy())
    assert marked["prediction"][refused].isna().all() and (marked["score_reason"][refused] == "non_finite:x").all()

    df = spark.createDataFrame(raw[["id", "x", "c"]])
    scored = predict_frame(df, named["model"], keep_columns=["id"]).toPandas().set_index("id")
    assert dict(predict_frame(df, named["model"]).dtypes)["prediction"] == "string"
    assert scored.loc[clean["id"], "prediction"].tolist() == out["prediction"].tolist()
    assert scored.loc[raw["id"][refused], "prediction"].isna().all()


def test_a_teacher_of_other_classes_is_refused_naming_both_lists(named, spark, tmp_path):
    """Explicit classes in another order: refused before any row is read. ``auto`` over rows whose
    class frequencies differ: refused once the classes are fitted, before pass one."""
    from common.config import from_dict, to_dict
    from pipelines.shard_config import ShardConfig
    from pipelines.shard_job import run_shard_job
    from shardtrain.teacher import teacher_scorer

    data = to_dict(_shard_config(named["src"], str(tmp_path / "explicit"), classes=["cat", "ant", "dog"]))
    data["teacher"] = {"model": named["model"], "temperature": 2.0}
    with pytest.raises(InputDataError, match=r"its classes are \['dog', 'ant', 'cat'\], but the dataset's "
                                             r"label.classes are \['cat', 'ant', 'dog'\]") as info:
        run_shard_job(spark, from_dict(ShardConfig, data), teacher_scorer())
    assert info.value.exit_code == EXIT_USAGE
    data["label"]["classes"], data["label"]["num_classes"] = "auto", None
    data["query"] = "SELECT id, x, c, CASE y WHEN 'dog' THEN 'ant' WHEN 'ant' THEN 'dog' ELSE y END AS y FROM raw"
    data["output"]["path"] = str(tmp_path / "auto")
    with pytest.raises(InputDataError, match=r"its classes are \['dog', 'ant', 'cat'\], but the dataset's "
                                             r"label.classes are \['ant', 'cat', 'dog'\]"):
        run_shard_job(spark, from_dict(ShardConfig, data), teacher_scorer())
    assert not os.path.exists(tmp_path / "explicit") and not os.path.exists(tmp_path / "auto")


@pytest.mark.parametrize("label, says", [
    ({"classes": ["a", "b"], "num_classes": 3}, r"label.num_classes is 3, but label.classes names 2 classes"),
    ({"classes": "auto", "task": "regression"}, r"label.classes names a class label's classes, but task=regression"),
    ({"classes": ["a", "b", "a"]}, r"label.classes names \['a'\] more than once"),
    ({"classes": None, "num_classes": None}, r"label.num_classes must be set .* or name the classes"),
])
def test_bad_class_settings_are_refused_naming_the_keys(tmp_path, label, says):
    with pytest.raises(ConfigError, match=says) as info:
        config(str(tmp_path), str(tmp_path / "out"), label={"column": "y", "num_classes": None, **label})
    assert info.value.exit_code == EXIT_USAGE


# --- multilabel: a list of classes per row -------------------------------------------------------

COLOURS = ["red", "green", "blue"]


def _colour_rows(spark) -> pd.DataFrame:
    """120 rows whose classes follow x1 and x2 (red: x1 > 0, green: x2 > 0, blue: both), some with
    none; then a val row naming a class train never saw (pink), and a row with a null class."""
    rng = np.random.default_rng(1)
    split = _split_of(spark, list(range(300)))
    x1, x2 = rng.normal(0, 1, 120), rng.normal(0, 1, 120)
    labels = [[c for c, on in zip(COLOURS, (a > 0, b > 0, a > 0 and b > 0)) if on] for a, b in zip(x1, x2)]
    pink = next(i for i in range(120, 300) if split[i] == "val")
    frame = pd.DataFrame({"id": list(range(120)) + [pink, pink + 1], "x1": [*x1, 1.0, 1.0], "x2": [*x2, 1.0, 1.0],
                          "y": labels + [["red", "pink"], ["red", None]]})
    frame["c"] = "k"
    return frame


@pytest.fixture(scope="module")
def multilabel(spark, tmp_path_factory):
    """The colour rows sharded as ``task: multilabel`` (classes auto), a model trained on them."""
    from pipelines.shard_job import run_shard_job
    from train_configs import train_config
    from training import train

    root = tmp_path_factory.mktemp("multilabel")
    raw = _colour_rows(spark)
    src = write_parquet(root / "raw", _columns(raw))
    cfg = config(src, str(root / "ds"), features={"numeric": ["x1", "x2"], "categorical": ["c"]},
                 label={"column": "y", "task": "multilabel", "num_classes": None, "classes": "auto", "threshold": 0.4},
                 split={"key": "id", "fractions": FRACTIONS})
    result = run_shard_job(spark, cfg)
    run = train(train_config(result.uri, str(root / "model"), "train.epochs=6", "train.batch_size=16",
                             "train.lr=0.1", "model.hidden=[16]", "data.shuffle_buffer_rows=64"))
    return {"raw": raw, "dataset": result, "run": run}


@pytest.mark.stack  # the shard job's SQL (lambdas over the list) on each stack
def test_a_list_of_classes_is_stored_multi_hot_and_trains_with_f1_per_class(multilabel):
    manifest, run = multilabel["dataset"].manifest, multilabel["run"]
    label = manifest.label
    assert label.task == "multilabel" and label.classes == ("red", "green", "blue") and label.threshold == 0.4
    assert manifest.data["quarantine"]["by_reason"] == {"invalid_label": 1, "unknown_class": 1}
    assert manifest.column("label") == {"name": "label", "dtype": "float32", "shape": [3]}
    train = np.stack(read_split(manifest.root.path, "train").column("label").to_pylist())
    assert set(np.unique(train)) == {0.0, 1.0} and (train.sum(axis=1) == 0).any()  # a row of no class too
    assert list(label.train_class_counts) == train.sum(axis=0).astype(int).tolist()
    assert label.train_rows == manifest.rows("train")
    final = run.final
    assert final["val_micro_f1"] > final["baseline_micro_f1"] and final["val_macro_f1"] > final["baseline_macro_f1"]
    assert {f"val_f1/{name}" for name in COLOURS} <= set(final) and final["val_f1/red"] > 0.8
    assert "validation micro_f1:" in run.summary()


@pytest.mark.stack  # predict on each stack's pandas, score on each pyspark
def test_predict_and_score_give_each_class_its_probability_and_the_set_at_the_threshold(multilabel, spark):
    from scoring.predict import predict_frame
    from training import load_model

    raw = multilabel["raw"].iloc[:120]
    for program in (False, True):
        model = load_model(multilabel["run"].model_uri, program=program)
        out = model.predict(raw[["x1", "x2", "c"]])
        assert list(out.columns) == ["probabilities", "prediction"]
        probabilities = np.stack(out["probabilities"].to_numpy())
        assert probabilities.shape == (120, 3) and not np.allclose(probabilities.sum(axis=1), 1.0)  # a sigmoid each
        assert out["prediction"].tolist() == [[c for c, p in zip(COLOURS, row) if p >= 0.4] for row in probabilities]
    right = np.mean([set(p) == set(t) for p, t in zip(out["prediction"], raw["y"])])
    assert right > 0.7, right
    scored = predict_frame(spark.createDataFrame(raw[["id", "x1", "x2", "c"]]), multilabel["run"].model_uri,
                           keep_columns=["id"]).toPandas().set_index("id").loc[raw["id"]]
    assert [list(p) for p in scored["prediction"]] == out["prediction"].tolist()
    np.testing.assert_allclose(np.stack(scored["probabilities"].to_numpy()), probabilities, rtol=0, atol=1e-6)


def test_multilabel_settings_are_checked_naming_the_key(tmp_path, spark):
    with pytest.raises(ConfigError, match=r"label.threshold applies to task=multilabel, not task=classification"):
        config(str(tmp_path), str(tmp_path / "out"), label={"column": "y", "threshold": 0.3})
    with pytest.raises(ConfigError, match=r"^teacher is set, but a multilabel label takes no teacher"):
        config(str(tmp_path), str(tmp_path / "out"), label={"column": "y", "task": "multilabel", "num_classes": 3},
               teacher={"model": str(tmp_path / "m")})
    from pipelines.shard_job import run_shard_job

    src = write_parquet(tmp_path / "raw", {"id": list(range(4)), "x": [1.0] * 4, "c": ["a"] * 4, "y": ["red"] * 4})
    with pytest.raises(InputDataError, match=r"column 'y' \(label.column\) .* has type string, which cannot be cast to "
                                             r"a list of class names") as info:
        run_shard_job(spark, config(src, str(tmp_path / "out"),
                                    label={"column": "y", "task": "multilabel", "num_classes": None, "classes": "auto"}))
    assert info.value.exit_code == EXIT_USAGE and not os.path.exists(tmp_path / "out")
