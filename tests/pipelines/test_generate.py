"""The generator writes the same content for the same arguments: each digest below was recorded
from the generator before its split into column builders (main at 22409db), over every kind of
column, label and bad row it can write, so a refactor that changes one value fails here."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipelines.generate import generate_dataset

pytestmark = [pytest.mark.spark, pytest.mark.stack]

CASES = {
    "parquet-classification-array-bad": (
        dict(rows=3000, seed=7, array_shape=[2, 3], num_classes=3, bad_rows=40),
        "8144d922dbb07b2979caec692ad48362abd944829622aa9e9c1ce5784843ce1f"),
    "parquet-regression-nulls-bad": (
        dict(rows=500, seed=1, numeric=3, categorical=0, task="regression", null_fraction=0.2, bad_rows=7),
        "aadbc37119884b92652193c0aa0894d5ac13e83749f418f919777e17fd1a3fb4"),
    "csv-classification-malformed": (
        dict(rows=800, seed=2, format="csv", categorical=3, vocab_size=5, bad_rows=10, partitions=3),
        "efc6c1ac54d4748f7a3d86e001575b4e022f902802b78e01ed12924a4b6dff1d"),
    "json-array-malformed": (
        dict(rows=1000, seed=3, format="json", array_shape=[4], num_classes=4, bad_rows=25),
        "ad5f8f42866aa7f3efe8e444b1bb7faad48890abd529006a98fb6ba35e02cc31"),
    "parquet-clean": (
        dict(rows=200, seed=0, numeric=1, categorical=1, null_fraction=0.0),
        "5de85d2e29e9cc75e673131d2c1b7c65f48708e9b4d23f9b7a603f4353e2c241"),
}


def content_digest(data) -> str:
    """sha256 of what was written (row content in id order, or every text line sorted) and of
    everything the returned GeneratedDataset says about it except its path."""
    digest = hashlib.sha256()
    # ``text`` (the text columns, issue 44) came later: left out where empty, so the digests hold.
    described = {k: v for k, v in dataclasses.asdict(data).items() if k != "path" and not (k == "text" and not v)}
    digest.update(json.dumps(described, sort_keys=True).encode())
    root = Path(data.path)
    if data.format == "parquet":
        table = pq.read_table(root).sort_by("id")
        digest.update(str(table.schema.remove_metadata()).encode())
        for row in table.to_pylist():
            digest.update(json.dumps(row).encode())  # repr of a float is exact; NaN/inf are spelled out
    else:
        lines = []
        for part in sorted(p for p in root.iterdir() if p.name.startswith("part-")):
            lines += part.read_bytes().splitlines()
        for line in sorted(lines):
            digest.update(line + b"\n")
    return digest.hexdigest()


@pytest.mark.parametrize("name", sorted(CASES))
def test_same_arguments_write_the_same_content_as_before_the_split(spark, tmp_path, name):
    kwargs, expected = CASES[name]
    data = generate_dataset(spark, str(tmp_path / name), **kwargs)
    assert content_digest(data) == expected
