"""Making a manifest: the one way to build one (``build_manifest``: the schema follows from the
feature, label and teacher records, the fingerprint from the content, and the result passes the
validation every reader runs), writing it, and the stored columns' Arrow schema and row size.
Producers use this (the shard job, tests, benchmarks); readers use ``common.dataset``."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from common import __version__
from common.dataset import (FORMAT, FORMAT_VERSION, MANIFEST_NAME, ROW_INDEX, TEACHER_COLUMN, record_task,
                            teacher_shape, validate_manifest)
from common.errors import DatasetError
from common.features import FeatureSpec
from common.storage import Location


_DTYPE_BYTES = {"float32": 4, "int32": 4, "int64": 8, "binary": 0}  # binary: its fitted row_bytes


def stored_schema(features: dict, label: dict, teacher: dict | None = None) -> list[dict]:
    """The stored columns, in file order, that a feature, label (and teacher) spec imply (see the module doc)."""
    cols = FeatureSpec(features).stored_columns()
    task = record_task(label, "label", "the manifest being built")
    shape = list(task.label_shape(label.get("num_classes")))  # a multilabel label's multi-hot vector
    cols.append({"name": label["name"], "dtype": task.label_dtype, "shape": shape})
    if teacher is not None:
        cols.append({"name": TEACHER_COLUMN, "dtype": "float32", "shape": teacher_shape(teacher)})
    cols.append({"name": ROW_INDEX, "dtype": "int64", "shape": []})
    return cols


def is_list_type(type_) -> bool:
    """An Arrow list type (how array features and soft targets are stored)."""
    import pyarrow as pa

    return pa.types.is_list(type_) or pa.types.is_large_list(type_) or pa.types.is_fixed_size_list(type_)


def value_type(type_):
    """A list type's innermost value type (an array feature's float32); any other type itself."""
    while is_list_type(type_):
        type_ = type_.value_type
    return type_


def arrow_schema(columns: list[dict]):
    """The Parquet (Arrow) schema of the stored columns; arrays are stored flattened as lists."""
    import pyarrow as pa

    types = {"float32": pa.float32(), "int32": pa.int32(), "int64": pa.int64(), "binary": pa.binary()}
    return pa.schema([pa.field(c["name"], pa.list_(types[c["dtype"]]) if c["shape"] else types[c["dtype"]],
                               nullable=False) for c in columns])


def build_manifest(splits: dict, features: dict, label: dict, teacher: dict | None = None, **extra: Any) -> dict:
    """The one way to make a manifest: the schema follows from the specs, the fingerprint from the
    content, and the result passes the same validation every reader runs. ``teacher``: the
    soft-target record (see the module doc), when the splits store a teacher column. ``extra``
    adds the producer's own fields (config, accounting, sources, ...)."""
    import datetime as _dt

    features = FeatureSpec(features).spec  # the ordered list (a dict by kind is listed)
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "shardtrain_version": __version__,
        "created_at": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "schema": stored_schema(features, label, teacher),
        "features": features,
        "label": label,
        "row_index_column": ROW_INDEX,
        "splits": splits,
        **({"teacher": teacher} if teacher is not None else {}),
        **extra,
        "fingerprint": fingerprint(splits, features, label, teacher),
    }
    validate_manifest(manifest, "the manifest being built")
    return manifest


def write_manifest(root: Location, manifest: dict) -> None:
    """Strict JSON only: a NaN or infinite statistic (``std: Infinity``) is refused, not written
    as a manifest no JSON reader but Python's accepts."""
    try:
        text = json.dumps(manifest, indent=2, sort_keys=False, allow_nan=False)
    except ValueError as exc:
        raise DatasetError(f"{root.uri}: the manifest would hold a non-finite number ({exc}); nothing was published: "
                           "this is a bug, report it with the input that caused it") from None
    root.write_text(MANIFEST_NAME, text + "\n")


def row_bytes(schema: list[dict], features: list[dict] | None = None) -> int:
    """Stored (uncompressed) bytes of one row of ``schema`` (the manifest's column list); an
    encoded (binary) column counts as the mean its feature record's fit measured (``row_bytes``:
    an image's stored bytes), where ``features`` (the manifest's records) are given."""
    fitted = sum(int(f.get("row_bytes", 0)) for f in features or [])
    return fitted + sum(_DTYPE_BYTES[c["dtype"]] * math.prod(c["shape"] or [1]) for c in schema)


def fingerprint(splits: dict, features: dict, label: dict, teacher: dict | None = None) -> str:
    """A content fingerprint: equal data and preprocessing (and teacher) give an equal fingerprint."""
    h = hashlib.sha256()
    payload = {
        "splits": {s: [(f["path"], f["rows"], f["sha256"]) for f in info["files"]] for s, info in sorted(splits.items())},
        "features": features,
        "label": label,
    }
    if teacher is not None:  # only then, so datasets without one keep their fingerprints
        payload["teacher"] = teacher
    h.update(json.dumps(payload, sort_keys=True).encode())
    return h.hexdigest()
