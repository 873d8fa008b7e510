"""A folder of images in class folders through the real shard job (``binaryFile``, labels from the
path through the query): the bad files quarantined with their reasons, keeping the path and byte
length but not the bytes; the odd ones converted and stored at size; mean and std fitted on train;
row groups sized on the encoded bytes, never a dictionary; a re-run gives the same files. One shard
job run, the session's ``image_dataset`` (tests/conftest.py), shared with the other image tests."""

from __future__ import annotations

import dataclasses
import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from common.config import from_dict
from common.images import decode_image, stored_image
from pipelines.shard_config import ShardConfig
from pipelines.shard_job import run_shard_job
from shard_testdata import file_hashes, manifest_without_timestamps, read_split

pytestmark = pytest.mark.spark


def label_of(path: str) -> str:
    return Path(path).parent.name


def stored_rows(root: str, splits=("train", "val", "test")) -> list[tuple[bytes, str]]:
    """(stored bytes, class name) of every published row."""
    manifest = json.loads(Path(root, "_manifest.json").read_text())
    classes = manifest["label"]["classes"]
    rows = []
    for split in splits:
        table = read_split(root, split)
        rows += [(c, classes[y]) for c, y in zip(table.column("content").to_pylist(), table.column("label").to_pylist())]
    return rows


def test_bad_files_are_quarantined_with_their_reason_path_and_length_not_bytes(image_dataset):
    folder, expected, cfg, result = image_dataset
    quarantine = pq.read_table(Path(result.uri, "_quarantine")).to_pylist()
    found = {}
    for row in quarantine:
        raw = json.loads(row["raw"])
        path = raw["path"].removeprefix("file:")
        found[path] = row["reason"]
        assert raw["content"] == os.path.getsize(path)  # the byte length, not the bytes
        assert len(row["raw"]) < 300
    bad = {p: f"{rule}:content" for p, rule in expected.items() if rule is not None}
    assert found == bad and len(bad) == 3
    assert result.manifest.data["quarantine"]["by_reason"] == dict(Counter(bad.values()))
    accounting = result.manifest.data["accounting"]
    assert accounting["input_rows"] == len(expected)  # LICENSE.txt left out by pathGlobFilter, as in the fingerprint
    assert accounting["published_rows"] == len(expected) - 3


def test_every_taken_file_is_stored_once_converted_at_size_under_its_class(image_dataset):
    folder, expected, cfg, result = image_dataset
    image = cfg.features.images["content"]
    want = Counter()
    for path, rule in expected.items():
        if rule is None:
            data, _ = stored_image(Path(path).read_bytes(), image.size, image.channels, image.resize, image.format,
                                   image.quality, image.max_pixels)
            want[(data, label_of(path))] += 1
    got = stored_rows(result.uri)
    assert Counter(got) == want  # the odd ones (1x1, 16-bit, CMYK, gray, palette, EXIF) among them
    for data, _ in got:
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert decode_image(data, (16, 16), 3).shape == (3, 16, 16)
    label = result.manifest.data["label"]
    assert sorted(label["classes"]) == ["cat", "dog", "fox"]  # from the folder names, most frequent first
    assert label["train_class_counts"] == sorted(label["train_class_counts"], reverse=True)


def test_mean_and_std_are_the_train_pixels_and_row_groups_follow_the_encoded_bytes(image_dataset):
    folder, expected, cfg, result = image_dataset
    (record,) = result.manifest.data["features"]
    pixels = np.stack([decode_image(d, (16, 16), 3) for d, _ in stored_rows(result.uri, ("train",))]) / 255.0
    assert np.allclose(record["mean"], pixels.mean(axis=(0, 2, 3)), atol=1e-5)  # the sample (1,024 rows at most) is every train row here
    assert np.allclose(record["std"], pixels.std(axis=(0, 2, 3)), atol=1e-5)
    sizes = [len(d) for d, _ in stored_rows(result.uri, ("train",))]
    assert abs(record["row_bytes"] - np.mean(sizes)) <= 1
    rows_per_group = int(0.01 * (1 << 20)) // (record["row_bytes"] + 16)  # + label and _row, int64 each
    assert result.manifest.data["rows_per_row_group"] == rows_per_group < 20
    for split in ("train", "val", "test"):
        for path in sorted(Path(result.uri, split).glob("part-*.parquet")):
            meta = pq.ParquetFile(path).metadata
            assert max(meta.row_group(g).num_rows for g in range(meta.num_row_groups)) <= rows_per_group
            for g in range(meta.num_row_groups):
                content = meta.row_group(g).column(0)
                assert content.path_in_schema == "content"
                assert not content.has_dictionary_page and "RLE_DICTIONARY" not in content.encodings
                assert not content.is_stats_set  # no whole images copied into the footer


def test_a_rerun_gives_the_same_files(image_dataset, spark, tmp_path):
    folder, expected, cfg, result = image_dataset
    again = dataclasses.replace(cfg, output=dataclasses.replace(cfg.output, path=str(tmp_path / "again")))
    run_shard_job(spark, from_dict(ShardConfig, json.loads(json.dumps(dataclasses.asdict(again)))))
    assert file_hashes(str(tmp_path / "again")) == file_hashes(result.uri)
    a, b = manifest_without_timestamps(result.uri), manifest_without_timestamps(str(tmp_path / "again"))
    assert a["features"] == b["features"] and a["splits"] == b["splits"]


def test_inspect_shows_the_image_feature_and_html_thumbnails_per_class(image_dataset):
    from pipelines.describe import dataset_report_html, describe_dataset

    folder, expected, cfg, result = image_dataset
    (record,) = result.manifest.data["features"]
    text = describe_dataset(result.manifest)
    assert "images content 3x16x16" in text
    assert f"image content: 3 x 16 x 16 (crop), stored png, ~{record['row_bytes']:,} bytes a row; mean [" in text
    assert "undecodable_image:content             2" in text and "image_too_large:content               1" in text
    rows_per_group = result.manifest.data["rows_per_row_group"]
    assert f"row groups up to {rows_per_group} rows = 0.0 MiB" in text  # encoded bytes counted (0.01 MiB asked)
    html = dataset_report_html(result.manifest)
    grid = html[html.index('<table class="thumbnails">'):]
    grid = grid[:grid.index("</table>")]
    for name in ("cat", "dog", "fox"):  # the first train file holds every class here
        row = grid[grid.index(f"<th>{name}</th>"):]
        row = row[:row.index("</tr>")]
        assert 1 <= row.count("<img") <= 8 and row.count("data:image/png;base64,") == row.count("<img")
