"""Column names as users have them, through shard, train and score on real Spark (local[2]): a
feature, the label or a kept column named with ``-``, a space, a single quote, a backtick or
non-ASCII letters is read, typed, quarantined (the reason names it as it is), stored, trained on
and scored like any other; the scores equal ``load_model(uri).predict`` on the same rows."""

from __future__ import annotations

import json
import os

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.features import FeatureSpec
import yaml

from common.config import from_dict
from pipelines.shard_config import ShardConfig
from pipelines.shard_job import run_shard_job
from train_configs import train_config
from training import load_model, train

pytestmark = pytest.mark.stack

PRICE, AGE, TICK = "price-usd", "it's", "tick`s"  # numeric
NAME, CITY = "first name", "städt ü"  # categorical
VECTOR = "vec`tor-ü 'x'"  # array
LABEL = "lab-el"
SHAPE = [3]


def raw_rows(n: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    price, age, tick = rng.normal(0, 1, n), rng.normal(5, 2, n), rng.normal(0, 1, n)
    names = rng.choice(["ann", "bob", "zoë"], n)
    cities = rng.choice(["köln", "paris", "o'hare"], n)
    vector = rng.normal(0, 1, (n, SHAPE[0]))
    signal = 2 * price - (age - 5) + vector[:, 0] + (names == "zoë")
    return pd.DataFrame({"id": np.arange(n), PRICE: price, AGE: age, TICK: tick, NAME: names, CITY: cities,
                         VECTOR: list(vector), LABEL: (signal > 0).astype(np.int64)})


def write_parquet(frame: pd.DataFrame, path) -> str:
    os.makedirs(path, exist_ok=True)
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), os.path.join(path, "part-0.parquet"))
    return str(path)


@pytest.fixture(scope="module")
def published(spark, tmp_path_factory):
    """A dataset sharded from raw rows with awkward names (two of them bad rows), and a model trained on it."""
    root = tmp_path_factory.mktemp("names")
    frame = raw_rows(400, seed=1)
    frame.loc[3, PRICE] = float("inf")
    frame.loc[4, NAME] = "n" * 2000
    source = write_parquet(frame, root / "raw")
    cfg = from_dict(ShardConfig, {
        "sources": {"raw": {"path": source, "format": "parquet"}},
        "features": {"numeric": [PRICE, AGE, TICK], "categorical": [NAME, CITY], "arrays": {VECTOR: SHAPE}},
        "label": {"column": LABEL, "task": "classification", "num_classes": 2},
        "split": {"key": "id", "fractions": {"train": 0.8, "val": 0.2}},
        "output": {"path": str(root / "dataset"), "num_shards": 2},
        "quality": {"max_bad_fraction": 0.5}})
    dataset = run_shard_job(spark, cfg)
    train_cfg = train_config(dataset, f"{root}/model", "train.epochs=1", "train.batch_size=32", "model.hidden=[8]",
                             "data.shuffle_buffer_rows=100")
    return {"frame": frame, "source": source, "dataset": dataset, "model": train(train_cfg).model_uri}


def test_shard_reads_quarantines_and_stores_columns_under_their_own_names(published):
    manifest = published["dataset"].manifest.data
    assert manifest["quarantine"]["by_reason"] == {f"non_finite:{PRICE}": 1, f"too_long:{NAME}": 1}
    stored = [c["name"] for c in manifest["schema"]]
    assert {PRICE, AGE, TICK, NAME, CITY, VECTOR} <= set(stored)
    stats = {s["name"]: s for s in FeatureSpec(manifest["features"]).by_kind()["numeric"]}
    clean = published["frame"].drop(index=[3, 4])
    # The train split's mean of each numeric feature is a mean of that column's own values (not another's).
    assert stats[AGE]["mean"] == pytest.approx(clean[AGE].mean(), abs=0.5)
    assert abs(stats[PRICE]["mean"]) < 0.5 and stats[PRICE]["std"] == pytest.approx(1, abs=0.3)
    vocab = {c["name"]: c["vocab"] for c in FeatureSpec(manifest["features"]).by_kind()["categorical"]}
    assert sorted(vocab[NAME]) == ["ann", "bob", "zoë"] and sorted(vocab[CITY]) == ["köln", "o'hare", "paris"]


def test_score_keeps_and_scores_columns_under_their_own_names(spark, published, tmp_path, capsys):
    """Also: score and load_model(uri).predict refuse what the shard job refused, by the shard job's
    own rules: a name of 2,000 bytes (its features.max_category_bytes was 1024: the model records
    it), text holding U+FFFD (what Spark reads a byte that is not UTF-8 as). Both were scored before,
    as unseen categories."""
    from shardtrain.cli import main

    model = load_model(published["model"])
    frame = raw_rows(60, seed=2)
    frame.at[7, VECTOR] = np.array([1.0, np.inf, 0.0])
    frame.loc[8, NAME], frame.loc[9, NAME], frame.loc[10, CITY] = "n" * 2000, "n" * 1024, "k\ufffdln"
    refused = {7: f"non_finite:{VECTOR}", 8: f"too_long:{NAME}", 10: "bad_encoding"}
    source = write_parquet(frame, tmp_path / "raw")
    out = tmp_path / "scores"
    config = tmp_path / "score.yaml"
    config.write_text(yaml.safe_dump({"model": published["model"], "sources": {"raw": {"path": source}},
                                      "output": {"path": str(out), "keep_columns": ["id", NAME, AGE]}}))
    assert main(["score", "--config", str(config)]) == 0, capsys.readouterr().err
    scored = pd.read_parquet(out, engine="pyarrow").sort_values("id")
    assert list(scored.columns) == ["id", NAME, AGE, "probabilities", "prediction"]
    clean = frame.drop(index=list(refused))
    assert scored["id"].tolist() == clean["id"].tolist() and scored[NAME].tolist() == clean[NAME].tolist()
    expected = model.predict(clean)
    np.testing.assert_allclose(np.stack(scored["probabilities"].to_numpy()), expected, rtol=0, atol=1e-6)
    quarantine = pd.read_parquet(out / "_quarantine")
    assert {json.loads(raw)["id"]: reason for raw, reason in zip(quarantine["raw"], quarantine["reason"])} == refused
    marked = model.predict(frame, errors="mark")
    assert {i: r for i, r in marked["score_reason"].items() if isinstance(r, str)} == refused
    assert model.features.max_category_bytes == published["dataset"].manifest.data["config"]["features"][
        "max_category_bytes"] == 1024

