"""Tiny published datasets for training tests, written directly with pyarrow (no Spark), with an
exact file / row-group layout so uneven layouts can be asked for by name.

They follow the manifest contract in pipelines/manifest.py: stored columns are what
``FeatureSpec.transform`` makes of the raw rows, ``_row`` numbers rows in manifest order, and a
``_COMMITTED`` marker is written last. ``raw`` keeps the raw frames, for ``predict`` round trips.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from common.commit_marker import MARKER
from common.dataset_files import file_entry
from common.manifest_builder import build_manifest, write_manifest
from common.features import FeatureSpec
from common.storage import resolve

CITIES = ["paris", "lyon", "nice", "lille", "nantes"]


@dataclass
class TestDataset:
    uri: str
    raw: dict[str, pd.DataFrame]  # split -> raw rows in `_row` order
    manifest: dict


TEXT_WORDS = ["the", "movie", "plot", "was", "naïve", "über", "日本語", "very"]
TEXT_SIGNAL = {"great": 1.5, "lovely": 1.5, "awful": -1.5, "boring": -1.5}
TEXT_MAX_TOKENS = 12


def raw_frame(rows: int, seed: int, task: str = "classification", array_shape: tuple | None = None,
              text: bool = False) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    x1 = rng.normal(0, 2, rows)
    x2 = rng.normal(5, 1, rows)
    city = rng.choice(CITIES, rows)
    city_effect = np.array([CITIES.index(c) for c in city]) - 2.0
    signal = 1.5 * x1 - 2.0 * (x2 - 5) + 0.8 * city_effect
    frame = pd.DataFrame({"x1": x1, "x2": x2, "city": city})
    if array_shape is not None:
        width = int(np.prod(array_shape))
        arr = rng.normal(0, 1, (rows, width)).astype(np.float32)
        signal = signal + 1.0 * arr[:, :4].sum(axis=1)
        frame["image"] = list(arr)
    if text:  # 0 to 30 words (an empty review too), one of them a word the label depends on
        sentiment = rng.choice(list(TEXT_SIGNAL), rows)
        signal = signal + np.array([TEXT_SIGNAL[w] for w in sentiment])
        lengths = rng.integers(0, 30, rows)
        frame["review"] = [" ".join([*rng.choice(TEXT_WORDS, n), w]) if n else "" for n, w in zip(lengths, sentiment)]
    if task == "classification":
        frame["label"] = (signal + rng.normal(0, 0.5, rows) > 0.6).astype(np.int64)
    else:
        frame["label"] = (signal + rng.normal(0, 0.3, rows)).astype(np.float32)
    # A few nulls so imputation is exercised.
    frame.loc[frame.index[::37], "x2"] = np.nan
    frame.loc[frame.index[::53], "city"] = None
    return frame


def _text_record(root: str, texts: list[str]) -> dict:
    """The text feature's record, its tokenizer trained on ``texts`` and written under ``root``."""
    from common.features.base import FILE_TEXTS
    from common.tokenizer import TextEncoder, length_statistics, sha256_text, train_tokenizer

    tokenizer = train_tokenizer(iter(texts), "wordpiece", 60, True)
    encoder = TextEncoder(tokenizer, TEXT_MAX_TOKENS, "head")
    path, digest = "_text/review/tokenizer.json", sha256_text(tokenizer)
    os.makedirs(os.path.join(root, "_text", "review"), exist_ok=True)
    with open(os.path.join(root, path), "w", encoding="utf-8") as fh:
        fh.write(tokenizer)
    return {"name": "review", "max_tokens": TEXT_MAX_TOKENS, "truncate": "head", "on_null": "empty",
            "vocab_size": encoder.vocab_size, "pad_id": encoder.pad_id,
            "tokenizer": {"type": "wordpiece", "path": path, "sha256": digest},
            "lengths": length_statistics(encoder.lengths(texts), TEXT_MAX_TOKENS),
            "files": [{"path": path, "sha256": digest}], FILE_TEXTS: {path: tokenizer}}


def _soft_targets(raw: pd.DataFrame, record: dict):
    """The teacher column for ``raw``: a regression value, or probabilities as a list column."""
    signal = 1.5 * raw["x1"].to_numpy() - 2.0 * (raw["x2"].fillna(5).to_numpy() - 5)
    if record["task"] == "regression":
        return signal.astype(np.float32)
    classes = record["num_classes"]
    logits = np.stack([signal * k / (classes - 1) for k in range(classes)], axis=1) / record["temperature"]
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs = (probs / probs.sum(axis=1, keepdims=True)).astype(np.float32)
    return pa.ListArray.from_arrays(pa.array(np.arange(0, probs.size + 1, classes, dtype=np.int32)),
                                    pa.array(probs.ravel()))


def write_dataset(root: str, layout: dict[str, list[list[int]]], task: str = "classification", seed: int = 0,
                  array_shape: tuple | None = None, committed: bool = True,
                  teacher: dict | None = None, classes: list[str] | None = None, text: bool = False) -> TestDataset:
    """``layout``: split -> files -> row-group sizes, e.g. {"train": [[300, 77], [13]], "val": [[200]]}.

    ``teacher``: store soft targets, as a shard job with a teacher does; the dict is merged into a
    record that fits the dataset ({"temperature": 2.0} by default; {"num_classes": 3} or
    {"features": ...} make a teacher that does not fit). The soft targets are a fixed function of
    the raw signal: softmax of (0, signal) / temperature over the teacher's classes.

    ``classes``: the two class names a classification label's record names (its values stay 0 and 1).

    ``text``: a text feature ``review`` with a WordPiece tokenizer trained on the train split's
    reviews and published beside the manifest, as the shard job does (``max_tokens`` TEXT_MAX_TOKENS)."""
    os.makedirs(root, exist_ok=True)
    raws = {split: raw_frame(sum(map(sum, files)), seed + i, task, array_shape, text)
            for i, (split, files) in enumerate(layout.items())}
    train = raws["train"]
    numeric = []
    for name in ("x1", "x2"):
        col = train[name].astype(float)
        mean, std = float(col.mean()), float(col.std()) or 1.0
        numeric.append({"name": name, "mean": mean, "std": std, "fill": mean})
    counts = train["city"].dropna().value_counts()
    categorical = [{"name": "city", "vocab": list(counts.index), "num_embeddings": len(counts) + 2}]
    features = {"numeric": numeric, "categorical": categorical,
                "arrays": [{"name": "image", "shape": list(array_shape)}] if array_shape else []}
    if text:
        features["text"] = [_text_record(root, train["review"].tolist())]
    for record in [*numeric, *categorical, *features["arrays"], *features.get("text", [])]:  # as the shard job does
        record["null_share"] = int(train[record["name"]].isna().sum()) / len(train) if len(train) else 0.0
    if task == "classification":
        label = {"name": "label", "task": "classification", "num_classes": 2,
                 **({"classes": classes} if classes is not None else {}),
                 "train_class_counts": np.bincount(train["label"], minlength=2).tolist()}
    else:
        label = {"name": "label", "task": "regression", "train_mean": float(train["label"].mean()),
                 "train_std": float(train["label"].std())}
    spec = FeatureSpec(features)
    record = None
    if teacher is not None:
        record = {"uri": "file:///teachers/t", "fingerprint": "f" * 64, "temperature": 2.0, "column": "teacher",
                  "task": task, **({"num_classes": 2} if task == "classification" else {}),
                  "features": {"numeric": ["x1", "x2"], "categorical": ["city"],
                               "arrays": [{"name": "image", "shape": list(array_shape)}] if array_shape else []},
                  **teacher}
    splits = {}
    for split, files in layout.items():
        raw = raws[split]
        stored = spec.transform(raw)
        # Each scalar feature as the shard writer stores it (its kind decides); the array as a list column.
        columns = {name: spec.stored_values(name, raw[name]) for name in spec.columns if name != "image"}
        if array_shape:
            flat = stored["image"].reshape(len(raw), -1)
            columns["image"] = pa.ListArray.from_arrays(
                pa.array(np.arange(0, flat.size + 1, flat.shape[1], dtype=np.int32)), pa.array(flat.ravel()))
        columns["label"] = raw["label"].to_numpy()
        if record is not None:
            columns["teacher"] = _soft_targets(raw, record)
        columns["_row"] = np.arange(len(raw), dtype=np.int64)
        table = pa.table(columns)
        entries, start = [], 0
        os.makedirs(os.path.join(root, split), exist_ok=True)
        for i, groups in enumerate(files):
            rel = f"{split}/part-{i:05d}.parquet"
            with pq.ParquetWriter(os.path.join(root, rel), table.schema) as writer:
                for size in groups:
                    writer.write_table(table.slice(start, size), row_group_size=max(size, 1))
                    start += size
            entries.append(file_entry(resolve(root), rel))
        splits[split] = {"rows": len(raw), "files": entries}
    manifest = build_manifest(splits, spec.published(), label, teacher=record, config={})
    write_manifest(resolve(root), manifest)
    if committed:
        with open(os.path.join(root, MARKER), "w") as fh:
            fh.write("{}")
    return TestDataset(uri=root, raw=raws, manifest=manifest)
