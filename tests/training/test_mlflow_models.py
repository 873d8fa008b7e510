"""A trained model as an MLflow model, against real MLflow: a SQLite tracking store and registry and a
local artifact root in tmp_path, no server. Training with tracking.mlflow.registered_model and alias
logs the pyfunc model and registers it; ``models:/NAME@ALIAS`` then gives the same predictions
through ``mlflow.pyfunc`` and ``spark_udf`` as ``load_model`` and ``shardtrain score`` do, refuses the
same rows with the same reasons, and takes the frames pandas and Spark read from integer source
columns; a pyfunc logged before keeps its output; the score job records the version it used and scores again only when the alias moved; a flipped byte in the
artifact store is refused by name; a registry nobody answers at costs training one warning and
fails scoring with exit 1 naming the URI."""

from __future__ import annotations

import glob
import json
import logging
import os

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from common.commit_marker import MARKER
from common.errors import ConfigError, DatasetError, InputDataError
from spark_cluster import refused_port
from tabular_data import raw_frame, write_dataset
from train_configs import train_overrides
from training import load_model, load_train_config, train

pytest.importorskip("mlflow")
import mlflow.pyfunc  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

SHAPE = (4,)
EXPERIMENT = "shardtrain-models"
FEATURES = ["x1", "x2", "city", "image", "review"]  # review: a text feature (issue 44), raw strings in


class Registry:
    """The module's MLflow store (tracking + registry in one SQLite file) and its trained models."""

    def __init__(self, root, new_store):
        self.root = root
        self.uri = new_store(root)  # sqlite:///{root}/mlflow.db
        self.client = MlflowClient(tracking_uri=self.uri)
        # A local artifact root of its own (MLflow's default would be ./mlruns in the working directory).
        self.client.create_experiment(EXPERIMENT, artifact_location=str(root / "artifacts"))
        self.dataset = write_dataset(str(root / "ds"), {"train": [[400]], "val": [[100]]}, array_shape=SHAPE, text=True)

    def train(self, model_path, name: str, *extra: str):
        return train(load_train_config(None, train_overrides(
            self.dataset, str(model_path), "train.epochs=2", "train.batch_size=32", "train.lr=0.01", "model.hidden=[8]",
            f"tracking.mlflow.tracking_uri={self.uri}", f"tracking.mlflow.experiment={EXPERIMENT}",
            f"tracking.mlflow.registered_model={name}", *extra)))

    def artifact_dir(self, name: str, version: str) -> str:
        """The published model directory inside the artifact store, for this version."""
        source = self.client.get_model_version_download_uri(name, version)
        (found,) = glob.glob(os.path.join(source.removeprefix("file://"), "artifacts", "*", "model.safetensors"))
        return os.path.dirname(found)


@pytest.fixture(scope="module")
def registry(tmp_path_factory, mlflow_store):
    reg = Registry(tmp_path_factory.mktemp("mlflow-models"), mlflow_store)
    reg.model = reg.train(reg.root / "model", "demo_model", "tracking.mlflow.alias=champion").model_uri
    return reg


@pytest.fixture
def mlflow_env(registry, monkeypatch):
    """MLflow's default tracking URI (and so registry) for the test: what a user's environment sets."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", registry.uri)
    return registry


def raw_rows(n: int, seed: int) -> pd.DataFrame:
    """Raw rows with nulls (numeric and categorical), categories the model never saw, an array column."""
    frame = raw_frame(n, seed, "classification", SHAPE, text=True).drop(columns=["label"])
    frame.loc[frame.index[5::11], "city"] = "atlantis"
    frame["image"] = [np.asarray(v, dtype=np.float32) for v in frame["image"]]
    frame.insert(0, "id", np.arange(n, dtype=np.int64))
    assert frame["x2"].isna().any() and frame["city"].isna().any() and (frame["city"] == "atlantis").any()
    return frame


@pytest.mark.stack  # mlflow's pyfunc on each stack's pandas and numpy
def test_the_registered_pyfunc_by_alias_predicts_what_load_model_does(mlflow_env, tmp_path):
    reg = mlflow_env
    (version,) = reg.client.search_model_versions("name='demo_model'")
    assert str(version.version) == "1"
    assert str(reg.client.get_model_version_by_alias("demo_model", "champion").version) == "1"
    frame = raw_rows(200, seed=3)
    expected = load_model(reg.model).predict(frame)
    pyfunc = mlflow.pyfunc.load_model("models:/demo_model@champion")
    out = pyfunc.predict(frame[FEATURES])
    assert list(out.columns) == ["probabilities", "score_reason"] and out["score_reason"].isna().all()
    np.testing.assert_allclose(np.stack(out["probabilities"].to_numpy()), expected, rtol=0, atol=1e-6)
    empty = pyfunc.predict(frame[FEATURES].iloc[0:0])  # was: cannot reshape tensor of 0 elements
    assert list(empty.columns) == ["probabilities", "score_reason"] and len(empty) == 0
    by_alias = load_model("models:/demo_model@champion")
    np.testing.assert_allclose(by_alias.predict(frame), expected, rtol=0, atol=1e-6)
    assert by_alias.fingerprint == load_model(reg.model).fingerprint  # the very model training published
    assert len(set(expected.argmax(axis=1))) == 2  # not a constant model: agreement means something

    signature = pyfunc.metadata.signature
    assert signature.inputs.input_names() == FEATURES  # every raw feature column, in the model's order
    types = {column["name"]: column["type"] for column in signature.inputs.to_dict()}
    # the row rules decide, as in shard; a text column takes strings (the model's tokenizer encodes them)
    assert types == {"x1": "any", "x2": "any", "city": "any", "image": "array", "review": "string"}
    assert signature.inputs.to_dict()[3]["items"] == {"type": "double"}
    assert signature.outputs.to_dict() == [
        {"type": "array", "items": {"type": "float"}, "name": "probabilities", "required": False},
        {"type": "string", "name": "score_reason", "required": False}]
    # Nothing is unpickled: the logged model holds no pickle, and its code builds the PythonModel.
    local = mlflow.artifacts.download_artifacts("models:/demo_model/1", dst_path=str(tmp_path / "dl"))
    files = [os.path.relpath(p, local) for p in glob.glob(f"{local}/**", recursive=True) if os.path.isfile(p)]
    assert not [f for f in files if f.endswith((".pkl", ".pickle", ".cloudpickle"))], files
    requirements = open(os.path.join(local, "requirements.txt")).read()
    assert "shardtrain==0.1.0" in requirements and "torch==" in requirements
    assert "pyspark" not in requirements and "horovod" not in requirements
    example = json.load(open(os.path.join(local, "input_example.json")))
    assert example["columns"] == FEATURES and len(example["data"]) == 5


@pytest.mark.stack  # spark_udf (pandas UDF) and the score job on each pyspark
def test_spark_udf_by_alias_equals_shardtrain_score_by_alias(spark, mlflow_env, tmp_path, capsys):
    """The same probabilities, and the same rows refused for the same reasons: the UDF (pandas,
    ``common.rows.frame_refusals``) marks what score (Spark SQL) quarantines."""
    from shardtrain.cli import main

    frame = raw_rows(150, seed=5)
    frame.loc[3, "x1"], frame.loc[4, "x2"], frame.loc[5, "city"] = 1e300, np.inf, "k\ufffdln"
    refused = {3: "non_finite:x1", 4: "non_finite:x2", 5: "bad_encoding"}
    source = str(tmp_path / "raw")
    os.makedirs(source)
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), os.path.join(source, "part-0.parquet"))
    udf = mlflow.pyfunc.spark_udf(spark, "models:/demo_model@champion")  # the signature's struct
    marked = spark.read.parquet(source).select("id", udf(*FEATURES).alias("p")).select("id", "p.*").toPandas()
    marked = marked.set_index("id").sort_index()
    assert set(marked.index[marked["probabilities"].isna()]) == set(refused)
    assert marked.loc[list(refused), "score_reason"].to_dict() == refused
    # MLflow's struct conversion writes a null string beside a non-null one as text: 'None' (pandas 2)
    # or 'nan' (pandas 3). The probabilities' null is what tells a taken row in a spark_udf's result.
    assert set(marked.drop(index=list(refused))["score_reason"].map(str)) <= {"None", "nan"}
    by_udf = marked.drop(index=list(refused)).reset_index().rename(columns={"probabilities": "p"})

    out = tmp_path / "scores"
    config = tmp_path / "score.yaml"
    config.write_text(yaml.safe_dump({"model": "models:/demo_model@champion", "sources": {"raw": {"path": source}},
                                      "output": {"path": str(out), "keep_columns": ["id"]}}))
    assert main(["score", "--config", str(config)]) == 0, capsys.readouterr().err
    scored = pd.read_parquet(out, engine="pyarrow").sort_values("id")
    assert scored["id"].tolist() == by_udf["id"].tolist() == [i for i in range(150) if i not in refused]
    quarantine = pd.read_parquet(out / "_quarantine")
    assert {json.loads(raw)["id"]: reason for raw, reason in zip(quarantine["raw"], quarantine["reason"])} == refused
    np.testing.assert_allclose(np.stack(scored["probabilities"].to_numpy()), np.stack(by_udf["p"].to_numpy()),
                               rtol=0, atol=1e-6)
    marker = json.loads((out / MARKER).read_text())
    assert marker["model"] == "models:/demo_model@champion"
    assert marker["model_version"]["version"] == "1" and marker["model_version"]["name"] == "demo_model"
    assert json.loads((out / "_scores.json").read_text())["model_version"] == marker["model_version"]


@pytest.mark.stack  # each stack's pandas and pyspark read the source types their own way
def test_the_pyfunc_takes_the_frames_pandas_and_spark_read_from_integer_source_columns(spark, mlflow_env, tmp_path):
    """A user reads the raw rows the way they have them: pandas from CSV or Parquet, Spark's
    toPandas(). An integer column arrives as int64, and as float64 where it holds a null; the
    pyfunc refused int64 ("Incompatible input types for column x1. Can not safely convert int64
    to float64") where load_model(uri).predict took it. Now both give the same predictions."""
    frame = raw_rows(40, seed=17)
    frame["x1"] = frame["x1"].round().astype(np.int64)  # an integer source column
    frame["x2"] = frame["x2"].round().astype("Int64")  # an integer source column with nulls
    csv, parquet = tmp_path / "raw.csv", tmp_path / "raw"
    frame.drop(columns=["image"]).to_csv(csv, index=False)
    os.makedirs(parquet)
    # As a Spark job or a database export writes it: integers, and no pandas dtypes in its metadata.
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False).replace_schema_metadata(None),
                   parquet / "part-0.parquet")
    assert pq.read_schema(parquet / "part-0.parquet").field("x2").type == pa.int64()
    read = {"pandas CSV": pd.read_csv(csv).assign(image=frame["image"]), "pandas Parquet": pd.read_parquet(parquet),
            "Spark toPandas": spark.read.parquet(str(parquet)).toPandas()}
    pyfunc = mlflow.pyfunc.load_model("models:/demo_model@champion")
    model = load_model("models:/demo_model@champion")
    for how, rows in read.items():
        rows = rows.sort_values("id").reset_index(drop=True)
        assert rows["x1"].dtype == np.int64 and rows["x2"].dtype == np.float64, how  # the frame the user has
        out = pyfunc.predict(rows[FEATURES])
        assert out["score_reason"].isna().all(), how
        np.testing.assert_allclose(np.stack(out["probabilities"].to_numpy()), model.predict(rows), rtol=0, atol=1e-6,
                                   err_msg=how)


@pytest.mark.stack  # how each stack's pandas and pyarrow hold bytes, a 10-million-character str, a float in an object column
def test_the_pyfunc_marks_refused_rows_and_one_logged_before_keeps_its_output(mlflow_env, tmp_path):
    """The pyfunc scores a batch: a row the rules refuse (1e300, a 10-million-character category,
    text that is not UTF-8) is marked with its reason and gets no probabilities, the others are
    scored; load_model(uri).predict raises naming the row. A pyfunc logged before (its signature
    a float32 tensor, no model_config) keeps that signature and output, and raises on such a row."""
    from mlflow.models.signature import ModelSignature
    from mlflow.types import ColSpec, DataType, Schema, TensorSpec
    from mlflow.types.schema import Array

    from common.model_registry import ARTIFACT_KEY, mlflow_uris
    from training.mlflow_model import PYFUNC_CODE, pip_requirements

    reg = mlflow_env
    frame = raw_rows(30, seed=19)
    expected = load_model(reg.model).predict(frame)
    bad = frame.astype({"x1": object, "city": object})
    bad.loc[2, "x1"], bad.loc[6, "city"], bad.loc[9, "city"] = 1e300, "x" * 10_000_000, b"k\xf6ln"
    refused = {2: "non_finite:x1", 6: "too_long:city", 9: "bad_encoding"}
    marked = mlflow.pyfunc.load_model("models:/demo_model@champion").predict(bad[FEATURES])
    assert {i: r for i, r in marked["score_reason"].items() if isinstance(r, str)} == refused
    assert marked.loc[list(refused), "probabilities"].isna().all()
    kept = [i for i in range(30) if i not in refused]
    np.testing.assert_allclose(np.stack(marked.loc[kept, "probabilities"].to_numpy()), expected[kept], rtol=0, atol=1e-6)
    with pytest.raises(InputDataError, match=r"^row 2, column 'x1' \(value 1e\+300\): non_finite:x1"):
        load_model("models:/demo_model@champion").predict(bad)

    # Logged as the releases before logged it: the same code and artifact, the tensor signature, no model_config.
    before = ModelSignature(
        inputs=Schema([ColSpec(DataType.double, "x1"), ColSpec(DataType.double, "x2"), ColSpec(DataType.string, "city"),
                       ColSpec(Array(DataType.double), "image"),
                       ColSpec(DataType.string, "review")]),  # the fixture's text feature (releases before had none)
        outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, 2))]))
    with mlflow_uris(reg.uri), mlflow.start_run(experiment_id=reg.client.get_experiment_by_name(EXPERIMENT).experiment_id):
        info = mlflow.pyfunc.log_model(name="model", python_model=PYFUNC_CODE, artifacts={ARTIFACT_KEY: reg.model},
                                       signature=before, pip_requirements=pip_requirements())
    old = mlflow.pyfunc.load_model(info.model_uri)
    assert old.metadata.signature.outputs.to_dict() == before.outputs.to_dict()
    np.testing.assert_allclose(old.predict(frame[FEATURES]), expected, rtol=0, atol=1e-6)
    assert old.predict(frame[FEATURES].iloc[0:0]).shape == (0, 2)
    bad["x1"] = bad["x1"].astype(np.float64)  # what its signature takes
    with pytest.raises(InputDataError, match=r"^row 2, column 'x1' \(value 1e\+300\): non_finite:x1"):
        old.predict(bad[FEATURES])


def test_a_pyfunc_of_a_model_trained_from_notebook_code_runs_that_code_only_when_the_loader_trusts_it(mlflow_env,
                                                                                                      tmp_path):
    """A model given to train() in code holds that code: its pyfunc refuses to load naming
    trust_code, and with model_config trust_code it predicts what load_model(trust_code=True) does."""
    from common.model_registry import ARTIFACT_KEY, mlflow_uris
    from training.mlflow_model import MODEL_CONFIG, PYFUNC_CODE, pip_requirements
    from user_code_cells import notebook_code

    reg = mlflow_env
    trained = train(load_train_config(None, train_overrides(reg.dataset, str(tmp_path / "model"), "train.epochs=1",
                                                            "model.kwargs.width=8")), model=notebook_code()["model"])
    with mlflow_uris(reg.uri), mlflow.start_run(experiment_id=reg.client.get_experiment_by_name(EXPERIMENT).experiment_id):
        info = mlflow.pyfunc.log_model(name="model", python_model=PYFUNC_CODE,
                                       artifacts={ARTIFACT_KEY: trained.model_uri},
                                       pip_requirements=pip_requirements(), model_config=MODEL_CONFIG)
    with pytest.raises(Exception, match=r"trust_code=True"):
        mlflow.pyfunc.load_model(info.model_uri)
    frame = raw_rows(20, seed=3)[FEATURES]
    pyfunc = mlflow.pyfunc.load_model(info.model_uri, model_config={**MODEL_CONFIG, "trust_code": True})
    np.testing.assert_allclose(np.stack(pyfunc.predict(frame)["probabilities"].to_numpy()),
                               load_model(trained.model_uri, trust_code=True).predict(frame), rtol=0, atol=1e-6)


def test_a_moved_alias_is_scored_again_and_a_pinned_version_is_not(spark, mlflow_env, tmp_path, capsys):
    from shardtrain.cli import main

    reg = mlflow_env
    # Version 1: the module's trained model (demo_model version 1), registered under this name as
    # MLflow registers any logged model; training registering and moving an alias is version 2 below.
    logged = reg.client.get_model_version("demo_model", "1")
    reg.client.create_registered_model("moving_model")
    version = reg.client.create_model_version("moving_model", source=logged.source, run_id=logged.run_id,
                                              model_id=getattr(logged, "model_id", None)).version
    reg.client.set_registered_model_alias("moving_model", "prod", str(version))
    assert str(version) == "1"
    first = reg.model
    source = str(tmp_path / "raw")
    os.makedirs(source)
    frame = raw_rows(60, seed=9)
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), os.path.join(source, "part-0.parquet"))

    def score(model: str, out) -> str:
        config = tmp_path / "score.yaml"
        config.write_text(yaml.safe_dump({"model": model, "sources": {"raw": {"path": source}},
                                          "output": {"path": str(out), "keep_columns": ["id"],
                                                     "mode": "skip_if_exists"}}))
        capsys.readouterr()
        assert main(["score", "--config", str(config)]) == 0, capsys.readouterr().err
        return capsys.readouterr().out

    def probabilities(out) -> np.ndarray:
        return np.stack(pd.read_parquet(out, engine="pyarrow").sort_values("id")["probabilities"].to_numpy())

    by_alias, pinned = tmp_path / "by-alias", tmp_path / "pinned"
    score("models:/moving_model@prod", by_alias)
    score("models:/moving_model/1", pinned)
    assert "unchanged, skipped" in score("models:/moving_model@prod", by_alias)  # nothing moved: no work
    pinned_marker = (pinned / MARKER).read_bytes()

    second = reg.train(tmp_path / "m2", "moving_model", "tracking.mlflow.alias=prod", "train.seed=7").model_uri
    assert str(reg.client.get_model_version_by_alias("moving_model", "prod").version) == "2"  # the alias really moved
    assert load_model(second).fingerprint != load_model(first).fingerprint

    assert "published" in score("models:/moving_model@prod", by_alias)  # scored again, with version 2
    assert json.loads((by_alias / MARKER).read_text())["model_version"]["version"] == "2"
    np.testing.assert_allclose(probabilities(by_alias), load_model(second).predict(frame), rtol=0, atol=1e-6)
    assert "unchanged, skipped" in score("models:/moving_model/1", pinned)  # the pinned version: no work
    assert (pinned / MARKER).read_bytes() == pinned_marker
    np.testing.assert_allclose(probabilities(pinned), load_model(first).predict(frame), rtol=0, atol=1e-6)
    assert "unchanged, skipped" in score("models:/moving_model@prod", by_alias)


def test_score_tasks_read_the_resolved_version_from_the_artifact_store_not_the_registry(spark, mlflow_env, tmp_path):
    """The driver resolves a registered version once; with a file-system artifact store the Python
    workers read its files there, and never import MLflow or open the registry: with the registry's
    database gone after the driver resolved (predict_frame is lazy), the tasks still score it, and
    nothing opened the database again (a worker asking the registry would have made a new, empty one)."""
    from scoring.predict import predict_frame

    reg = mlflow_env
    # A name no Python worker has loaded yet (a worker keeps the model it loaded, by URI).
    logged = reg.client.get_model_version("demo_model", "1")
    reg.client.create_registered_model("offline_model")
    reg.client.create_model_version("offline_model", source=logged.source, run_id=logged.run_id,
                                    model_id=getattr(logged, "model_id", None))
    frame = raw_rows(40, seed=11)
    source = str(tmp_path / "raw")
    os.makedirs(source)
    pq.write_table(pa.Table.from_pandas(frame, preserve_index=False), os.path.join(source, "part-0.parquet"))
    scored = predict_frame(spark.read.parquet(source), "models:/offline_model/1", keep_columns=["id"])

    database = reg.root / "mlflow.db"
    aside = reg.root / "mlflow.db.aside"
    os.rename(database, aside)
    try:
        assert not database.exists()  # the registry is really gone while the tasks run
        rows = scored.toPandas().sort_values("id")
        assert not database.exists(), "a worker opened the registry"
    finally:
        if database.exists():
            os.remove(database)
        os.rename(aside, database)
    assert rows["id"].tolist() == list(range(40))
    np.testing.assert_allclose(np.stack(rows["probabilities"].to_numpy()), load_model(reg.model).predict(frame),
                               rtol=0, atol=1e-6)


def test_a_flipped_byte_in_the_artifact_store_is_refused_naming_the_file(mlflow_env):
    reg = mlflow_env
    weights = os.path.join(reg.artifact_dir("demo_model", "1"), "model.safetensors")
    original = open(weights, "rb").read()
    assert original == open(os.path.join(reg.model, "model.safetensors"), "rb").read()
    flipped = bytearray(original)
    flipped[len(flipped) // 2] ^= 0x01
    try:
        with open(weights, "wb") as fh:
            fh.write(flipped)
        assert open(weights, "rb").read() != original  # the artifact store's file really changed
        with pytest.raises(DatasetError, match=r"models:/demo_model@champion \(version 1\)/model\.safetensors: "
                                               r"does not match the sha256 recorded in model\.json"):
            load_model("models:/demo_model@champion")
        with pytest.raises(Exception, match=r"model\.safetensors: does not match the sha256 recorded in model\.json"):
            mlflow.pyfunc.load_model("models:/demo_model@champion").predict(raw_rows(20, seed=1)[FEATURES])
    finally:
        with open(weights, "wb") as fh:
            fh.write(original)


def test_a_registry_nobody_answers_at_warns_in_training_and_fails_scoring_with_exit_1(
        spark, registry, tmp_path, caplog, capsys, monkeypatch):
    from shardtrain.cli import main

    registry_uri = f"http://127.0.0.1:{refused_port()}"
    with caplog.at_level(logging.WARNING, logger="shardtrain.train"):
        result = registry.train(tmp_path / "model", "unreachable_model", f"tracking.mlflow.registry_uri={registry_uri}",
                                "tracking.mlflow.alias=champion", "train.epochs=1")
    assert os.path.exists(os.path.join(result.model_uri, MARKER))  # trained and published
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "unreachable_model" in warnings[0] and registry_uri in warnings[0]
    (run,) = registry.client.search_runs([registry.client.get_experiment_by_name(EXPERIMENT).experiment_id],
                                         filter_string=f"tags.model_uri = '{result.model_uri}'")
    assert run.info.status == "FINISHED"  # the run itself was tracked

    monkeypatch.setenv("MLFLOW_TRACKING_URI", registry_uri)
    os.makedirs(tmp_path / "raw")
    out = tmp_path / "scores"
    config = tmp_path / "score.yaml"
    config.write_text(yaml.safe_dump({"model": "models:/demo_model@champion",
                                      "sources": {"raw": {"path": str(tmp_path / "raw")}}, "output": {"path": str(out)}}))
    capsys.readouterr()
    assert main(["score", "--config", str(config)]) == 1
    err = capsys.readouterr().err
    assert "models:/demo_model@champion" in err and registry_uri in err and "unreachable" in err
    assert not os.path.exists(out)


def test_registry_keys_are_checked_naming_the_key():
    base = ["data.path=/data/ds"]
    cfg = load_train_config(None, [*base, "tracking.mlflow.registered_model=main.ml.demo", "tracking.mlflow.alias=champion"])
    assert (cfg.tracking.mlflow.registered_model, cfg.tracking.mlflow.alias, cfg.tracking.mlflow.registry_uri) == \
        ("main.ml.demo", "champion", None)
    with pytest.raises(ConfigError, match=r"tracking\.mlflow\.alias needs tracking\.mlflow\.registered_model"):
        load_train_config(None, [*base, "tracking.mlflow.alias=champion"])
    with pytest.raises(ConfigError, match=r"tracking\.mlflow\.alias must be a name"):
        load_train_config(None, [*base, "tracking.mlflow.registered_model=m", "tracking.mlflow.alias='3'"])


def test_models_uris_of_another_form_are_refused_naming_the_uri():
    for uri in ("models:/demo_model", "models:/demo_model/latest", "models:/demo_model/Production"):
        with pytest.raises(DatasetError, match=f"^{uri}: not a model registry URI shardtrain reads"):
            load_model(uri)
    # A version no registry can hold (MLflow's SQLite store failed it as unreadable: exit 1, retried forever).
    with pytest.raises(DatasetError, match=r"^models:/demo_model/99999999999999999999999: version .* is beyond any "
                                           r"registry's numbering") as err:
        load_model("models:/demo_model/99999999999999999999999")
    assert err.value.exit_code == 2


@pytest.mark.parametrize("damage", ["deleted", "broken MLmodel"])
def test_a_version_whose_artifacts_are_deleted_or_broken_says_so(mlflow_env, damage):
    """Not "not a model shardtrain logged": what happened to the version's artifacts, exit 2."""
    import shutil

    reg = mlflow_env
    source = reg.client.get_model_version_download_uri("demo_model", "1").removeprefix("file://")
    kept = f"{source}.kept"
    shutil.copytree(source, kept)
    try:
        if damage == "deleted":
            shutil.rmtree(source)
            expected = r"its MLmodel file is missing from the version's artifacts \(deleted or moved"
        else:
            with open(os.path.join(source, "MLmodel"), "w") as fh:
                fh.write("flavors: [unclosed\n")
            expected = r"its MLmodel file is damaged \((Parser|Scanner)Error"
        with pytest.raises(DatasetError, match=rf"^models:/demo_model/1: {expected}") as err:
            load_model("models:/demo_model/1")
        assert "not a model shardtrain logged" not in str(err.value) and "\n" not in str(err.value)
    finally:
        shutil.rmtree(source, ignore_errors=True)
        os.rename(kept, source)


def test_named_classes_and_multilabel_add_the_prediction_to_the_signature():
    """A label that names its classes: the pyfunc's output (``predict(frame, errors="mark")``) has the
    class's name as ``prediction`` after the probabilities; a label of indices keeps its two columns;
    a multilabel label's prediction is its list of classes."""
    from common.dataset import LabelSpec
    from training.mlflow_model import output_schema

    named = output_schema(LabelSpec("label", "classification", num_classes=2, classes=("no", "yes"))).to_dict()
    assert [(c["name"], c["type"]) for c in named] == [
        ("probabilities", "array"), ("prediction", "string"), ("score_reason", "string")]
    indices = output_schema(LabelSpec("label", "classification", num_classes=2)).to_dict()
    assert [c["name"] for c in indices] == ["probabilities", "score_reason"]
    # multilabel: the classes at or above the threshold, a list of names (or of indices)
    sets = output_schema(LabelSpec("label", "multilabel", num_classes=2, classes=("no", "yes"))).to_dict()
    assert sets[1] == {"type": "array", "items": {"type": "string"}, "name": "prediction", "required": False}
    sets = output_schema(LabelSpec("label", "multilabel", num_classes=2)).to_dict()
    assert sets[1]["items"] == {"type": "long"}
