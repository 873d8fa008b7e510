"""Serving an image model on raw encoded bytes: ``predict`` and ``score``'s Spark path decode each
file as the shard job stored it, and a bad file is a reason, never a failed job. The model is a
published model's ``LoadedModel`` around a tiny hand-made network (the brightest channel is the
class, as tests/image_files.py draws them), so these tests need no training launch; the session's
``image_dataset`` gives the manifest's features and label."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from common.images import decode_image
from common.model_artifact import LoadedModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import image_files  # noqa: E402



def read_split(root: str, split: str) -> pa.Table:
    return pa.concat_tables([pq.read_table(f) for f in sorted(Path(root, split).glob("part-*.parquet"))])

pytestmark = pytest.mark.spark


class BrightestChannel(torch.nn.Module):
    """uint8 [B, 3, H, W] -> class probabilities: the class whose channel has the highest mean
    (``image_files.CLASSES[c]`` is drawn brightest in channel c) wins."""

    def __init__(self, classes: list[str]):
        super().__init__()
        self.register_buffer("order", torch.tensor([image_files.CLASSES.index(name) for name in classes]))

    def forward(self, batch):
        means = batch["content"].float().mean(dim=(2, 3)) / 255.0
        return torch.softmax(means[:, self.order] * 50.0, dim=-1)


def model_of(result) -> LoadedModel:
    manifest = json.loads(Path(result.uri, "_manifest.json").read_text())
    return LoadedModel(BrightestChannel(manifest["label"]["classes"]),
                       {"features": manifest["features"], "label": manifest["label"]})


def raw_files(expected: dict) -> pa.Table:
    paths = sorted(expected)
    return pa.table({"path": paths, "content": pa.array([Path(p).read_bytes() for p in paths], pa.binary())})


def test_predict_on_raw_bytes_sees_the_pixels_training_read_and_marks_bad_files(image_dataset):
    folder, expected, cfg, result = image_dataset
    model = model_of(result)
    files = raw_files(expected)
    out = model.predict(files, errors="mark")
    reasons = dict(zip(files.column("path").to_pylist(), out["score_reason"]))
    assert reasons == {p: None if rule is None else f"{rule}:content" for p, rule in expected.items()}
    for path, predicted in zip(files.column("path").to_pylist(), out["prediction"]):
        if Path(path).stem.isdigit():  # a class image (the odd ones have no class colour)
            assert predicted == Path(path).parent.name
    # What the network receives from raw bytes is what the ranks decode from the stored bytes.
    taken = files.filter(pa.array([expected[p] is None for p in files.column("path").to_pylist()]))
    served = model.features.transform(taken.select(["content"]))["content"]
    stored = [decode_image(v, (16, 16), 3) for split in ("train", "val", "test")
              for v in read_split(result.uri, split).column("content").to_pylist()]
    assert Counter(a.tobytes() for a in served) == Counter(a.tobytes() for a in stored)
    with pytest.raises(Exception, match=r"undecodable_image:content|image_too_large:content"):
        model.predict(files)  # errors="raise": a bad row names its reason


def test_score_batches_over_a_binary_file_folder_account_for_every_file(image_dataset, spark):
    """``score``'s Spark path, up to the model: binaryFile rows, the image check stage, the reason
    SQL, then ``score_batch`` (what each task runs) with the model."""
    from common.spark import to_spark_path
    from scoring.predict import ScoreTask, _prepared, check_feature_types, prepared_frame, reason_values, score_batch

    folder, expected, cfg, result = image_dataset
    model = model_of(result)
    df = spark.read.format("binaryFile").option("recursiveFileLookup", True) \
        .option("pathGlobFilter", "*.{png,jpg}").load(to_spark_path(str(folder)))
    fields = {f.name: f.dataType for f in df.schema.fields}
    check_feature_types(fields, model.features, False)
    assert reason_values(fields, model.features) == ["null_image:content", "undecodable_image:content",
                                                    "image_too_large:content"]
    task = ScoreTask(model_uri="unused", program=False, weights_sha256="", task="classification", num_classes=3,
                     keep_columns=("__kept_0",), features=(("content", "__feature_0"),), encoded=False,
                     temperature=1.0, batch_size=8, classes=tuple(model.label.classes))
    rows = _prepared(prepared_frame(df, model.features), task, ["path"], fields, model.features, False)
    collected = pa.Table.from_pandas(rows.toPandas(), preserve_index=False)  # a few dozen tiny rows
    scored = pa.Table.from_batches([score_batch(model, task, batch) for batch in collected.to_batches(max_chunksize=16)])
    paths = [p.removeprefix("file:") for p in scored.column("__kept_0").to_pylist()]
    assert sorted(paths) == sorted(expected)  # every file once: scored or refused
    for path, reason, predicted in zip(paths, scored.column("score_reason").to_pylist(),
                                       scored.column("prediction").to_pylist()):
        rule = expected[path]
        assert reason == (None if rule is None else f"{rule}:content")
        assert (predicted is None) == (rule is not None)
        if Path(path).stem.isdigit():
            assert predicted == Path(path).parent.name


def test_the_mlflow_signature_takes_the_raw_bytes(image_dataset):
    from mlflow.types import DataType

    from training.mlflow_model import signature

    folder, expected, cfg, result = image_dataset
    manifest = json.loads(Path(result.uri, "_manifest.json").read_text())
    inputs = {c.name: c.type for c in signature({"features": manifest["features"], "label": manifest["label"]}).inputs}
    assert inputs == {"content": DataType.binary}
    assert os.path.isdir(folder)
