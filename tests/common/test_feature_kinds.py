"""A kind of feature column is one module and one registry entry (issue 42): a boolean kind
written here, and registered as ``common.features.registry`` registers its own, takes part in the
manifest, the row rules, serving and the training loader's batches without a line changed
anywhere else."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from common.errors import DatasetError
from common.features import KINDS, FeatureSpec
from common.features.base import BatchEntry, FeatureKind
from common.rows import frame_refusals, reason_text
from common.sql import quote_identifier as q


class Boolean(FeatureKind):
    """A yes/no column, stored as float32 0/1; anything else (a null too) is refused as bad_value."""

    name = "boolean"
    typed_prefix = "_b_"

    @staticmethod
    def config_key(name):
        return "features.boolean"

    @staticmethod
    def spark_type_ok(dtype, stored=False):
        from pyspark.sql import types as T

        return isinstance(dtype, T.BooleanType)

    @staticmethod
    def wanted(stored=False):
        return "a boolean"

    def sql_reasons(self, name, dtype, stored=False):
        return [f"WHEN {q(name)} IS NULL THEN 'bad_value:{name}'"]

    @staticmethod
    def typed_sql(name, stored=False):
        return f"CAST({q(name)} AS FLOAT)" if stored else f"CAST({q(name)} AS BOOLEAN)"

    def stored_columns(self):
        return [{"name": name, "dtype": "float32", "shape": []} for name in self.names]

    def frame_checks(self, columns, n):
        return [(reason_text("bad_value", name), name,
                 np.array([v not in (True, False) for v in _listed(columns[name])], dtype=bool))
                for name in self.names]

    def encode_column(self, name, values):
        return np.asarray([bool(v) for v in _listed(values)], dtype=np.float32)

    def batch(self, frame, n):
        matrix = np.zeros((n, len(self.names)), dtype=np.float32)
        for j, name in enumerate(self.names):
            matrix[:, j] = self.encode_column(name, frame[name])
        return {self.name: matrix}

    def batch_keys(self):
        return [self.name] if self.names else []

    def batch_layout(self):
        return [BatchEntry(self.name, tuple(self.names), "float32")] if self.names else []

    def probe(self, rows):
        return {self.name: np.zeros((rows, len(self.names)), dtype=np.float32)} if self.names else {}


def _listed(values):
    return values.to_pylist() if hasattr(values, "to_pylist") else list(values)


@pytest.fixture
def boolean_kind():
    KINDS.append(Boolean)  # the one registry line, made at run time
    try:
        yield Boolean
    finally:
        KINDS.remove(Boolean)


FEATURES = [{"name": "x", "kind": "numeric", "mean": 1.0, "std": 2.0, "fill": 1.0},
            {"name": "member", "kind": "boolean"}]


def _published(tmp_path, label_task="regression"):
    from common.dataset import read_manifest
    from common.manifest_builder import build_manifest, write_manifest
    from common.publish import publish

    splits = {"train": {"rows": 1, "files": [{"path": "train/part-00000.parquet", "rows": 1, "row_groups": [1],
                                               "bytes": 9, "sha256": "0" * 64}]}}
    with publish(str(tmp_path / "ds")) as staging:
        write_manifest(staging, build_manifest(splits, FEATURES, {"name": "label", "task": label_task}))
    return read_manifest(str(tmp_path / "ds"))


def test_a_kind_of_our_own_takes_part_in_manifest_rules_serving_and_batches(boolean_kind, tmp_path):
    from pipelines.describe import describe_dataset
    from training.columns import columns_for, table_to_arrays

    manifest = _published(tmp_path)
    # the manifest: its stored column and its lines, in the order of the record
    assert [(c["name"], c["dtype"]) for c in manifest.data["schema"]][:2] == [("x", "float32"), ("member", "float32")]
    assert "1 numeric, 0 categorical, 1 boolean" in describe_dataset(manifest)
    spec = manifest.features
    assert spec.teacher_features()[-1] == {"name": "member", "kind": "boolean"}

    # the row rules on a frame: its own rule, in the registry's order, naming its column
    frame = pd.DataFrame({"x": [3.0, 5.0, "many"], "member": [True, None, False]})
    refusals = frame_refusals(frame, spec)
    assert refusals.reasons.tolist() == [None, "bad_value:member", "bad_value:x"]

    # serving: raw rows to the network's arrays, its entry beside the numeric matrix
    served = spec.transform(frame.iloc[[0]])
    assert served["boolean"].tolist() == [[1.0]] and served["numeric"].tolist() == [[1.0]]
    assert set(spec.probe(2)) == {"numeric", "categorical", "boolean"}

    # the training loader: stored rows to the same entry, through the kind's batch layout
    stored = pa.table({"x": pa.array([1.0, 0.0], pa.float32()), "member": pa.array([1.0, 0.0], pa.float32()),
                       "label": pa.array([0.5, 1.5], pa.float32()), "_row": pa.array([0, 1], pa.int64())})
    batch = table_to_arrays(stored, columns_for(manifest))
    assert batch["boolean"].tolist() == [[1.0], [0.0]] and batch["numeric"].tolist() == [[1.0], [0.0]]
    # and scoring an already-encoded table: the same entry, from the same layout
    assert spec.kind_of("member").stored_batch(stored, 2)["boolean"].tolist() == [[1.0], [0.0]]


def test_a_model_that_does_not_take_a_kind_refuses_its_dataset_naming_the_key(boolean_kind, tmp_path):
    """The built-in models declare the kinds they take (their specs); training a dataset that holds
    another kind with one is exit 2 before anything launches, naming model.name and the columns."""
    from train_configs import train_config
    from training.plan import build_plan

    manifest = _published(tmp_path)
    cfg = train_config(tmp_path / "ds", tmp_path / "model", "model.name=mlp")
    with pytest.raises(DatasetError, match=r"field 'features' holds \{'boolean': \['member'\]\}, which "
                                           r"model.name='mlp' cannot take \(it takes numeric, categorical, arrays"):
        build_plan(cfg, manifest)
    assert DatasetError.exit_code == 2


def test_a_dataset_of_a_kind_this_shardtrain_does_not_know_is_refused_naming_it(boolean_kind, tmp_path):
    from common.dataset import MANIFEST_NAME, read_manifest

    manifest = _published(tmp_path)
    KINDS.remove(Boolean)  # a reader without the kind
    try:
        with pytest.raises(DatasetError, match=r"field 'features\[member\]\.kind' is 'boolean'; expected one of"):
            read_manifest(str(tmp_path / "ds"))
        with pytest.raises(DatasetError, match=r"feature 'member' is of kind 'boolean'"):
            FeatureSpec(json.loads((tmp_path / "ds" / MANIFEST_NAME).read_text())["features"])
        assert manifest.features.columns == ["x", "member"]  # read while the kind was registered
    finally:
        KINDS.append(Boolean)
