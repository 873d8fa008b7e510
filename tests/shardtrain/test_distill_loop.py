"""Distillation on real Spark (local[2]), end to end: ``shardtrain distill``'s loop (teacher trained
on a shard, the same rows sharded again with its soft targets, a student trained from them) run
once for the module; then what a user relies on: the ``teacher`` column in every split is the
teacher's own predictions at T, the manifest records the teacher, and a teacher that does not fit
the dataset, or a teacher with nothing to run it, is refused before anything is written. A re-run
over the same rows laid out in other input partitions writing byte-identical soft targets is
tests/shardtrain/test_transfer_set.py's shard-command test (the same shard job and scorer)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

from common.dataset import read_manifest
from common.errors import EXIT_USAGE, ConfigError, InputDataError
from common.publish import read_marker

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # distill_transforms, named by a shard config

ROWS = 1500
TEMPERATURE = 2.0


def _shard_section(raw, out):
    return {"sources": {"raw": {"path": raw, "format": "parquet"}},
            "features": {"numeric": ["x0", "x1", "x2", "x3"], "categorical": ["c0", "c1"]},
            "label": {"column": "label", "task": "classification", "num_classes": 2},
            "split": {"key": "id", "fractions": {"train": 0.8, "val": 0.1, "test": 0.1}},
            "output": {"path": out, "num_shards": 2}}


def _train_section(model_path, hidden, **train):
    return {"model": {"hidden": hidden}, "launch": {"mode": "in_process", "num_proc": 1},
            "train": {"epochs": 1, "batch_size": 64, "lr": 0.005, **train},
            "data": {"shuffle_buffer_rows": 512}, "checkpoint": {"resume": "never"},
            "output": {"model_path": model_path}}


@pytest.fixture(scope="module")
def loop(spark, tmp_path_factory):
    from common.config import from_dict
    from pipelines.generate import generate_dataset
    from shardtrain.distill import DistillRunConfig, distill

    root = tmp_path_factory.mktemp("distill")
    raw = str(root / "raw")
    generate_dataset(spark, raw, ROWS, seed=7, partitions=2)
    cfg = from_dict(DistillRunConfig, {
        "shard": _shard_section(raw, str(root / "shards")),
        "teacher": _train_section(str(root / "teacher"), [64, 64]),
        "soft_targets": {"path": str(root / "shards-teacher"), "temperature": TEMPERATURE},
        "student": _train_section(str(root / "student"), [4], distill={"alpha": 0.5}),
    })
    result = distill(cfg, spark=spark)
    return {"root": root, "raw": raw, "cfg": cfg, "result": result,
            "plain": read_manifest(str(root / "shards")), "soft": read_manifest(str(root / "shards-teacher"))}


def _split_table(manifest, split, columns=None):
    import pyarrow as pa

    return pa.concat_tables([pq.read_table(os.path.join(manifest.root.path, f.path), columns=columns)
                             for f in manifest.files(split)])


def test_manifest_records_the_teacher(loop):
    teacher_uri = loop["cfg"].teacher.output.model_path
    record = loop["soft"].teacher.to_record()
    assert record == {"uri": teacher_uri, "fingerprint": read_marker(teacher_uri)["model_json_sha256"],
                      "temperature": TEMPERATURE, "column": "teacher", "task": "classification", "num_classes": 2,
                      "features": [*({"name": f"x{i}", "kind": "numeric"} for i in range(4)),
                                   {"name": "c0", "kind": "categorical"}, {"name": "c1", "kind": "categorical"}]}
    assert {"name": "teacher", "dtype": "float32", "shape": [2]} in loop["soft"].data["schema"]
    assert loop["plain"].teacher is None and "teacher" not in [c["name"] for c in loop["plain"].data["schema"]]


def test_every_split_stores_the_teachers_predictions_at_t(loop):
    """The same rows, balance and accounting as the plain dataset; each row's teacher column is the
    teacher's softmax(logits / T) on that row's features (to 1e-6, float32)."""
    from training.columns import columns_for, table_to_arrays
    from training.export import load_model

    plain, soft = loop["plain"], loop["soft"]
    teacher = load_model(loop["cfg"].teacher.output.model_path)
    assert soft.data["accounting"] == plain.data["accounting"]
    columns = columns_for(soft, teacher=True)
    for split in ("train", "val", "test"):
        assert [f.rows for f in soft.files(split)] == [f.rows for f in plain.files(split)]
        arrays = table_to_arrays(_split_table(soft, split), columns)
        stored = arrays.pop("teacher")
        assert stored.shape == (soft.rows(split), 2) and stored.dtype == np.float32
        inputs = {k: v for k, v in arrays.items() if k not in ("label", "_row")}
        np.testing.assert_allclose(stored, teacher.predict_arrays(inputs, TEMPERATURE), rtol=0, atol=1e-6)
        np.testing.assert_allclose(stored.sum(axis=1), 1.0, atol=1e-6)
        # Softer than the teacher's own probabilities (T = 2 > 1): a row's top probability is lower.
        assert (stored.max(axis=1) <= teacher.predict_arrays(inputs).max(axis=1) + 1e-6).all()


def test_the_student_was_distilled(loop):
    import json

    student = loop["result"].student.train
    meta = json.load(open(os.path.join(student.model_uri, "model.json")))
    assert meta["config"]["train"]["distill"] == {"alpha": 0.5, "temperature": TEMPERATURE}
    assert meta["dataset"]["fingerprint"] == loop["soft"].fingerprint
    assert all(np.isfinite(m["train_loss"]) for m in student.metrics)


def test_a_teacher_that_does_not_fit_the_dataset_is_refused_before_any_write(loop, spark, tmp_path):
    from pipelines import shard_dataset
    from shardtrain.teacher import teacher_scorer

    cfg = loop["cfg"].student_shard()
    cfg.features.numeric = ["x0", "x1"]
    cfg.output.path = str(tmp_path / "out")
    with pytest.raises(InputDataError, match=r"does not fit this dataset: its numeric features are "
                                             r"\['x0', 'x1', 'x2', 'x3'\], but the dataset's are \['x0', 'x1'\]") as info:
        shard_dataset(cfg, spark=spark, teacher_scorer=teacher_scorer())
    assert info.value.exit_code == EXIT_USAGE
    assert not os.path.exists(tmp_path / "out")


def test_a_teacher_with_no_scorer_is_a_clear_error(loop, spark, tmp_path):
    from pipelines import shard_dataset

    cfg = loop["cfg"].student_shard()
    cfg.output.path = str(tmp_path / "out")
    with pytest.raises(ConfigError, match="teacher is set, but this shard job was started without a teacher scorer"):
        shard_dataset(cfg, spark=spark)
    assert not os.path.exists(tmp_path / "out")
