"""Class labels that name their classes (``label.classes``), from the shard job to ``score``, on
real Spark (local[2]) and an in-process training: the class list is fitted on the train split
(most frequent first, ties by name), a val row of a class train never saw is quarantined
(``unknown_class``) as a null label is (``null_label``), the stored label is the class index, and
every output a user reads names the classes: ``load_model(...).predict``, ``score``'s
``prediction``, ``inspect``. A teacher whose classes are other names, or the same names in
another order, is refused (exit 2, naming both lists). The config's refusals name the keys."""

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
    src = write_parquet(root / "raw", {name: raw[name].tolist() for name in raw.columns})
    result = run_shard_job(spark, _shard_config(src, str(root / "ds")))
    model = train(train_config(result.uri, str(root / "model"), "train.epochs=8", "train.batch_size=8",
                               "train.lr=0.05", "model.hidden=[8]", "data.shuffle_buffer_rows=64")).model_uri
    return {"root": root, "raw": raw, "src": src, "dataset": result, "model": model}


@pytest.mark.stack  # the shard job's SQL and aggregation on each stack
def test_classes_are_fitted_on_train_and_other_classes_are_quarantined(named):
    manifest = named["dataset"].manifest
    assert manifest.label.classes == tuple(CLASSES) and manifest.label.num_classes == 3
    assert manifest.data["quarantine"]["by_reason"] == {"non_finite:x": 1, "null_label": 1, "unknown_class": 1}
    quarantined = quarantine(manifest.root.path).set_index("reason")["raw"].map(lambda r: yaml.safe_load(r).get("y"))
    assert quarantined.to_dict() == {"non_finite:x": "yak", "null_label": None, "unknown_class": "zebra"}
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
