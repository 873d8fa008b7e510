"""Small hand-made inputs and helpers for the shard job tests (no Spark needed to build them)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from common.config import from_dict
from pipelines.shard_config import ShardConfig


def write_parquet(path: Path, columns: dict, schema: pa.Schema | None = None) -> str:
    path.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns, schema=schema), path / "part-0.parquet")
    return str(path)


def simple_rows(n: int, start: int = 0) -> dict:
    """n clean rows: id, x (float), c (category), y (0/1)."""
    ids = list(range(start, start + n))
    return {"id": ids, "x": [float(i % 17) for i in ids], "c": [f"k{i % 5}" for i in ids], "y": [i % 2 for i in ids]}


def config(source: str, output_path: str, fmt: str = "parquet", **sections) -> ShardConfig:
    """A shard config over ``source``; each keyword updates that section, except ``sources``,
    which replaces the default single source."""
    base = {
        "sources": {"raw": {"path": source, "format": fmt}},
        "features": {"numeric": ["x"], "categorical": ["c"]},
        "label": {"column": "y", "task": "classification", "num_classes": 2},
        "split": {"key": "id", "fractions": {"train": 1.0}},
        "output": {"path": output_path, "num_shards": 2},
        "quality": {"max_bad_fraction": 1.0},
    }
    if "sources" in sections:
        base["sources"] = sections.pop("sources")
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return from_dict(ShardConfig, base)


def file_hashes(root: str) -> dict[str, str]:
    """sha256 of every data file under a dataset (manifest, marker and config excluded)."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            if name.endswith(".parquet"):
                full = os.path.join(dirpath, name)
                out[os.path.relpath(full, root)] = hashlib.sha256(Path(full).read_bytes()).hexdigest()
    return dict(sorted(out.items()))


def manifest_without_timestamps(root: str) -> dict:
    data = json.loads(Path(root, "_manifest.json").read_text())
    data.pop("created_at")
    return data


def read_split(root: str, split: str) -> pa.Table:
    files = sorted(Path(root, split).glob("part-*.parquet"))
    return pa.concat_tables([pq.read_table(f) for f in files])


def quarantine(root: str):
    return pq.read_table(Path(root, "_quarantine")).to_pandas()
