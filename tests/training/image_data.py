"""Tiny published image datasets for training tests, written directly with pyarrow (no Spark), as the
shard job publishes them (common/features/images.py): a binary column of each row's encoded bytes
(``format: keep``: the original files' bytes, so decoding a raw value is what the ranks decode), the
manifest's image record with the per-channel mean and std of the decoded pixels of the train split,
optionally a numeric feature beside it. ``raw`` keeps the raw frames, for ``predict`` round trips.

The pictures come from tests/image_files.py: RGB PNGs and JPEGs of 20 x 24 pixels whose class shows
in a bright channel, decoded and cropped to [16, 16]."""

from __future__ import annotations

import os

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from common.commit_marker import MARKER
from common.dataset_files import file_entry
from common.images import decode_image
from common.manifest_builder import build_manifest, write_manifest
from common.storage import resolve
from image_files import class_pixels, jpeg, png
from tabular_data import TestDataset

SIZE = [16, 16]


def image_frame(rows: int, seed: int, numeric: bool) -> pd.DataFrame:
    """Raw rows: ``photo`` (encoded bytes, PNG and JPEG alternating), ``label`` (3 classes), and with
    ``numeric`` an ``x1`` that carries part of the signal."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, rows)
    photos = []
    for i, label in enumerate(labels):
        pixels = class_pixels(int(label), seed * 100_000 + i, 24)[:20]
        photos.append(png(pixels) if i % 2 else jpeg(pixels))
    frame = pd.DataFrame({"photo": photos, "label": labels.astype(np.int64)})
    if numeric:
        frame.insert(0, "x1", (labels + rng.normal(0, 1, rows)).astype(np.float64))
    return frame


def image_record(train: pd.DataFrame) -> dict:
    """The manifest's record of ``photo``, its mean and std fitted on the train rows' decoded pixels."""
    pixels = np.stack([decode_image(v, SIZE, 3) for v in train["photo"]]).astype(np.float64) / 255
    return {"name": "photo", "size": list(SIZE), "channels": 3, "resize": "crop", "format": "keep", "quality": 90,
            "max_pixels": 50_000_000, "mean": pixels.mean(axis=(0, 2, 3)).round(6).tolist(),
            "std": pixels.std(axis=(0, 2, 3)).round(6).tolist(), "null_share": 0.0}


def write_image_dataset(root: str, layout: dict[str, list[list[int]]], numeric: bool = False,
                        seed: int = 0) -> TestDataset:
    """``layout``: split -> files -> row-group sizes, as tabular_data.write_dataset takes it."""
    os.makedirs(root, exist_ok=True)
    raws = {split: image_frame(sum(map(sum, files)), seed + i, numeric) for i, (split, files) in enumerate(layout.items())}
    train = raws["train"]
    features = {"numeric": [], "categorical": [], "arrays": [], "images": [image_record(train)]}
    if numeric:
        mean, std = float(train["x1"].mean()), float(train["x1"].std())
        features["numeric"] = [{"name": "x1", "mean": mean, "std": std, "fill": mean, "null_share": 0.0}]
    label = {"name": "label", "task": "classification", "num_classes": 3,
             "train_class_counts": np.bincount(train["label"], minlength=3).tolist()}
    splits = {}
    for split, files in layout.items():
        raw = raws[split]
        columns = {}
        if numeric:
            x1 = features["numeric"][0]
            columns["x1"] = ((raw["x1"].to_numpy() - x1["mean"]) / x1["std"]).astype(np.float32)
        columns["photo"] = pa.array(list(raw["photo"]), pa.binary())
        columns["label"] = raw["label"].to_numpy()
        columns["_row"] = np.arange(len(raw), dtype=np.int64)
        table = pa.table(columns)
        entries, start = [], 0
        os.makedirs(os.path.join(root, split), exist_ok=True)
        for i, groups in enumerate(files):
            rel = f"{split}/part-{i:05d}.parquet"
            with pq.ParquetWriter(os.path.join(root, rel), table.schema, use_dictionary=False) as writer:
                for size in groups:
                    writer.write_table(table.slice(start, size), row_group_size=max(size, 1))
                    start += size
            entries.append(file_entry(resolve(root), rel))
        splits[split] = {"rows": len(raw), "files": entries}
    manifest = build_manifest(splits, features, label, config={})
    write_manifest(resolve(root), manifest)
    with open(os.path.join(root, MARKER), "w") as fh:
        fh.write("{}")
    return TestDataset(uri=root, raw=raws, manifest=manifest)
