"""Image features: a column of encoded image bytes (JPEG, PNG, anything Pillow reads), stored
encoded and decoded near the network, never as float pixels.

The shard config declares each column with its size (``features.images: {photo: {size: [32, 32]}}``,
``ImageColumn``). The shard job decodes every image once to check it (``common.images``: EXIF
orientation, 16-bit / palette / CMYK / gray / RGB converted to ``channels``, alpha composited on
white, resized by ``resize``) in a Python/Arrow stage before the row rules (``prepared``), then
stores it re-encoded at size (``format: jpeg | png``) or its original bytes (``keep``) in a
Parquet binary column named after the feature. Fitted on a deterministic sample of the train
split: each channel's mean and std of pixel/255 (``fit``), which the network's image stem
normalises by. The network receives each image feature under its name as uint8 [rows, C, H, W]
(``BatchEntry.decode`` turns one stored value into a row).

Row rules (``common.rows`` convention, in this order): ``null_image:<col>`` (no bytes),
``undecodable_image:<col>`` (truncated, not an image, a format Pillow cannot read),
``image_too_large:<col>`` (the header claims more than ``max_pixels`` pixels: nothing is
decoded). The SQL form reads the check column the Python stage added (``check_column``); the
frame form (``frame_checks``, a loaded model's ``predict``) decodes. A quarantined row's raw text
keeps the bytes' length, not the bytes (``raw_sql``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import numpy as np

from common.config import require, setting
from common.errors import DatasetError
from common.features.base import BatchEntry, FeatureKind
from common.images import (DEFAULT_MAX_PIXELS, FORMATS, IMAGE_TOO_LARGE, NULL_IMAGE, RESIZE_MODES, RULES,
                           UNDECODABLE_IMAGE, ImageRejected, decode_image, decoder, encode_image, image_size,
                           stored_image)
from common.rows import reason, reason_text
from common.sql import quote_identifier as q

MAX_IMAGE_SIDE = 8192
PILLOW_MAX_PIXELS = 178_956_970  # 2 x PIL.Image.MAX_IMAGE_PIXELS: Pillow's own ceiling, which it raises for  # the configured size's ceiling per side: a typo fails at once
STATS_SAMPLE_ROWS = 1024  # train images the per-channel mean and std are fitted on (decoded in one task)
_CHECK = "__image_check_{}"  # the Python stage's column per feature: struct<rule, length, stored>


@dataclass
class ImageColumn:
    """One image column of the shard config (``features.images.<column>``)."""

    size: list[int] = setting("[height, width] every image is resized to (required: a batch has one shape)")
    channels: Literal[1, 3] = setting("1 (grayscale) or 3 (RGB); every image is converted to it", default=3)
    resize: Literal["crop", "pad", "stretch"] = setting(
        "how an image of another aspect ratio meets `size`: `crop` covers then cuts the center, `pad` fits "
        "inside then pads with black, `stretch` scales each side", default="crop")
    format: Literal["jpeg", "png", "keep"] = setting(
        "what is stored: `jpeg` or `png` re-encoded at `size`, or `keep` the original bytes untouched (resized "
        "and converted where it is decoded)", default="jpeg")
    quality: int = setting("JPEG quality (1-95) of `format: jpeg`", default=90)
    max_pixels: int = setting(
        "an image whose header claims more pixels is quarantined (`image_too_large:<column>`) without being "
        "decoded", default=DEFAULT_MAX_PIXELS)

    def __post_init__(self):
        size = self.size
        require(isinstance(size, list) and len(size) == 2 and all(isinstance(d, int) and 0 < d <= MAX_IMAGE_SIDE
                                                                  for d in size),
                "size", f"must be [height, width], two integers in [1, {MAX_IMAGE_SIDE}], got {size!r}")
        require(1 <= self.quality <= 95, "quality", f"must be in [1, 95], got {self.quality}")
        require(1 <= self.max_pixels <= PILLOW_MAX_PIXELS, "max_pixels",
                f"must be in [1, {PILLOW_MAX_PIXELS:,}] (Pillow refuses larger images as decompression bombs), "
                f"got {self.max_pixels}")


def check_column(name: str) -> str:
    """The Python stage's column holding feature ``name``'s check: struct<rule, length, stored>."""
    return _CHECK.format(name.replace("%", "%25").replace("`", "%60").replace(".", "%2E"))


class Images(FeatureKind):
    name = "images"
    required = ("name", "size", "channels", "resize", "format", "quality", "max_pixels", "mean", "std")
    typed_prefix = "_i_"
    columns_type = dict[str, ImageColumn]
    columns_help = ("column of encoded image bytes (a `binaryFile` source's `content`, a binary column) -> how "
                    "it is stored: `{photo: {size: [224, 224]}}`; the network receives uint8 [C, H, W]. Rows "
                    "quarantined: `null_image:<column>`, `undecodable_image:<column>`, `image_too_large:<column>`")

    def __init__(self, records: list[dict], max_category_bytes: int):
        super().__init__(records, max_category_bytes)
        self.by_name = {r["name"]: r for r in self.records}

    @classmethod
    def check_record(cls, record: dict, where: str) -> None:
        super().check_record(record, where)
        field = f"{where}: field 'features.images[{record.get('name')}]"
        size, channels = record["size"], record["channels"]
        if not (isinstance(size, list) and len(size) == 2 and all(isinstance(d, int) and d > 0 for d in size)):
            raise DatasetError(f"{field}.size' is {size!r}, not [height, width]")
        if channels not in (1, 3):
            raise DatasetError(f"{field}.channels' is {channels!r}, not 1 or 3")
        if record["resize"] not in RESIZE_MODES or record["format"] not in FORMATS:
            raise DatasetError(f"{field}': resize {record['resize']!r} / format {record['format']!r} unknown")
        for key in ("mean", "std"):
            values = record[key]
            if not (isinstance(values, list) and len(values) == channels
                    and all(isinstance(v, (int, float)) and math.isfinite(v) for v in values)):
                raise DatasetError(f"{field}.{key}' is {values!r}, not {channels} finite numbers")

    # --- the shard config and Spark -------------------------------------------------------------

    @classmethod
    def configured(cls, features_cfg) -> list[dict]:
        return [{"name": name, "size": list(c.size), "channels": int(c.channels), "resize": c.resize,
                 "format": c.format, "quality": int(c.quality), "max_pixels": int(c.max_pixels)}
                for name, c in features_cfg.images.items()]

    @staticmethod
    def config_key(name: str) -> str:
        return f"features.images.{name}"

    @staticmethod
    def spark_type_ok(dtype, stored: bool = False) -> bool:
        from pyspark.sql import types as T

        return isinstance(dtype, T.BinaryType)

    @staticmethod
    def wanted(stored: bool = False) -> str:
        return "binary (encoded image bytes)"

    def prepared(self, frame, store: bool):
        """``frame`` with each image feature's check (``check_column``) beside it: one decode per
        image, in a mapInArrow stage; with ``store``, the bytes the shard job stores (else null:
        scoring passes the raw bytes on). The SQL rules and typing read it."""
        if not self.records:
            return frame
        from pyspark.sql import types as T

        check = T.StructType([T.StructField("rule", T.StringType()), T.StructField("length", T.LongType()),
                              T.StructField("stored", T.BinaryType())])
        schema = T.StructType([*frame.schema.fields, *(T.StructField(check_column(n), check) for n in self.names)])
        records = tuple(dict(r) for r in self.records)
        return frame.mapInArrow(partial(_checked_batches, records=records, store=store), schema)

    def sql_reasons(self, name: str, dtype, stored: bool = False) -> list[str]:
        """A null value; then (raw values) the rule the Python stage found, each a literal reason."""
        rules = [f"WHEN {q(name)} IS NULL THEN {reason(NULL_IMAGE, name)}"]
        if not stored:
            rule = f"{q(check_column(name))}.rule"
            rules += [f"WHEN {rule} = '{r}' THEN {reason(r, name)}" for r in (UNDECODABLE_IMAGE, IMAGE_TOO_LARGE)]
        return rules

    @staticmethod
    def typed_sql(name: str, stored: bool = False) -> str:
        """The stored bytes the check made (shard job), else the value itself (scoring's raw bytes)."""
        if stored:
            return q(name)
        return f"coalesce({q(check_column(name))}.stored, {q(name)})"

    def prepared_columns(self) -> list[str]:
        return [check_column(n) for n in self.names]

    def raw_sql(self, name: str) -> str:
        return f"octet_length({q(name)})"

    # --- statistics fitted on the train split ---------------------------------------------------

    def fit(self, features_cfg, train) -> list[dict]:
        """Each feature's per-channel mean and std of pixel/255, over the decoded stored bytes of
        the first STATS_SAMPLE_ROWS train rows in shuffle-key order (the same rows on every run),
        summed as exact integers in Spark; and ``row_bytes``, the sample's mean stored bytes."""
        if not self.records:
            return []
        frame = train.frame()
        out = []
        for record in self.records:
            typed = self.typed(record["name"])
            sample = (frame.select(typed, "_shuffle", "_tiebreak").orderBy("_shuffle", "_tiebreak")
                      .limit(STATS_SAMPLE_ROWS).select(typed))
            parts = sample.mapInArrow(partial(_pixel_sums, record=dict(record), column=typed),
                                      "sums ARRAY<BIGINT>, squares ARRAY<BIGINT>, pixels BIGINT, bytes BIGINT, "
                                      "images BIGINT").collect()
            out.append({**record, **channel_stats(parts, int(record["channels"]))})
        return out

    # --- the manifest ---------------------------------------------------------------------------

    def stored_columns(self) -> list[dict]:
        return [{"name": name, "dtype": "binary", "shape": []} for name in self.names]

    def contract(self, record: dict) -> dict:
        return {"name": record["name"], "size": list(record["size"]), "channels": record["channels"]}

    def input_entry(self) -> dict:
        return {r["name"]: {"size": list(r["size"]), "channels": r["channels"]} for r in self.records}

    @classmethod
    def teacher_names(cls, entries: list) -> dict:
        return {e["name"]: {"size": list(e["size"]), "channels": e["channels"]} for e in entries}

    # --- row rules on a frame -------------------------------------------------------------------

    def frame_checks(self, columns: dict, n: int) -> list[tuple[str, str, np.ndarray]]:
        checks = []
        for record in self.records:
            name = record["name"]
            found = [_rule(v, record) for v in _listed(columns[name])]
            checks += [(reason_text(r, name), name, np.fromiter((f == r for f in found), dtype=bool, count=n))
                       for r in RULES]
        return checks

    # --- serving and the model input ------------------------------------------------------------

    def encode_column(self, name: str, values: Any) -> np.ndarray:
        """Raw encoded bytes -> uint8 [n, C, H, W], each decoded as the shard job and the ranks do."""
        record = self.by_name[name]
        decode = decoder(record)
        rows = [decode(v) for v in _listed(values)]
        if not rows:
            return np.zeros((0, record["channels"], *record["size"]), dtype=np.uint8)
        return np.stack(rows)

    def stored_values(self, name: str, values: Any) -> Any:
        return values  # the check's stored bytes (typed_sql), binary

    def batch_layout(self) -> list[BatchEntry]:
        return [BatchEntry(r["name"], (r["name"],), "uint8", (int(r["channels"]), *map(int, r["size"])),
                           decode=decoder(r)) for r in self.records]

    def batch(self, frame: Any, n: int) -> dict[str, np.ndarray]:
        return {name: self.encode_column(name, frame[name]) for name in self.names}

    def batch_keys(self) -> list[str]:
        return list(self.names)

    def probe(self, rows: int) -> dict[str, np.ndarray]:
        return {r["name"]: np.zeros((rows, r["channels"], *r["size"]), dtype=np.uint8) for r in self.records}

    def signature_columns(self) -> list:
        from mlflow.types import ColSpec, DataType

        return [ColSpec(DataType.binary, name) for name in self.names]

    def raw_example(self, name: str, stored: Any) -> list:
        return [bytes(v) for v in stored.to_pylist()]

    # --- inspect --------------------------------------------------------------------------------

    def summary_part(self) -> str:
        return "images " + ", ".join(f"{r['name']} {r['channels']}x{r['size'][0]}x{r['size'][1]}" for r in self.records)

    def detail_lines(self) -> list[str]:
        return [f"image {r['name']}: {r['channels']} x {r['size'][0]} x {r['size'][1]} ({r['resize']}), stored "
                f"{r['format']}{' q' + str(r['quality']) if r['format'] == 'jpeg' else ''}"
                f"{', ~' + format(r['row_bytes'], ',') + ' bytes a row' if 'row_bytes' in r else ''}; "
                f"mean {_rounded(r.get('mean'))}, std {_rounded(r.get('std'))}" for r in self.records]

    shows_samples = True

    def html_samples(self, table: Any, labels: list) -> list[str]:
        return [_thumbnail_grid(r["name"], table.column(r["name"]).to_pylist(), labels, decoder(r))
                for r in self.records]

    def html_table(self):
        from common.html_report import table

        if not self.records:
            return None
        return table(["image feature", "C x H x W", "resize", "stored", "mean", "std"],
                     [[r["name"], f"{r['channels']}x{r['size'][0]}x{r['size'][1]}", r["resize"], r["format"],
                       _rounded(r.get("mean")), _rounded(r.get("std"))] for r in self.records])


THUMBNAILS_PER_CLASS = 8


def _thumbnail_grid(name: str, values: list, labels: list, decode) -> str:
    """One row of thumbnails per class (its first THUMBNAILS_PER_CLASS rows), as an HTML table."""
    from common.html_report import escape, image

    by_class: dict = {}
    for value, label in zip(values, labels):
        shown = by_class.setdefault("all" if label is None else str(label), [])
        if len(shown) < THUMBNAILS_PER_CLASS:
            pixels = decode(value)
            shown.append(image(encode_image(pixels, "png"), f"{name} ({label})"))
    rows = "".join(f"<tr><th>{escape(label)}</th><td>{''.join(images)}</td></tr>"
                   for label, images in sorted(by_class.items()))
    return f'<table class="thumbnails"><caption>{escape(name)}: train samples by class</caption>{rows}</table>'


def _rounded(values) -> str:
    return "-" if values is None else "[" + ", ".join(f"{v:.3f}" for v in values) + "]"


def _listed(values) -> list:
    """A column's values (Arrow, pandas or a list) as a Python list of bytes or None."""
    if isinstance(values, list):
        return values
    if hasattr(values, "to_pylist"):
        return values.to_pylist()
    return [None if v is None or (isinstance(v, float) and math.isnan(v)) else v for v in values]


def _rule(value, record: dict) -> str | None:
    """One raw value's rule (``RULES``), None where it decodes."""
    if value is None:
        return NULL_IMAGE
    try:
        decode_image(value, record["size"], record["channels"], record["resize"], record["max_pixels"])
    except ImageRejected as e:
        return e.rule
    return None


def _checked_batches(batches, *, records: tuple[dict, ...], store: bool):
    """mapInArrow body of ``Images.prepared``: each batch with each feature's check appended."""
    import pyarrow as pa

    check_type = pa.struct([("rule", pa.string()), ("length", pa.int64()), ("stored", pa.binary())])
    for batch in batches:
        columns = list(batch.columns)
        names = list(batch.schema.names)
        for record in records:
            values = batch.column(batch.schema.get_field_index(record["name"])).to_pylist()
            rules, lengths, stored = [], [], []
            for value in values:
                rule, data = _checked(value, record, store)
                rules.append(rule)
                lengths.append(None if value is None else len(value))
                stored.append(data)
            columns.append(pa.StructArray.from_arrays(
                [pa.array(rules, pa.string()), pa.array(lengths, pa.int64()), pa.array(stored, pa.binary())],
                fields=list(check_type)))
            names.append(check_column(record["name"]))
        yield pa.RecordBatch.from_arrays(columns, names=names)


def _checked(value, record: dict, store: bool) -> tuple[str | None, bytes | None]:
    """(rule, stored bytes): the value decoded once; the bytes only with ``store`` and no rule."""
    if value is None:
        return NULL_IMAGE, None
    try:
        if not store:
            decode_image(value, record["size"], record["channels"], record["resize"], record["max_pixels"])
            return None, None
        data, _ = stored_image(value, record["size"], record["channels"], record["resize"], record["format"],
                               record["quality"], record["max_pixels"])
        return None, data
    except ImageRejected as e:
        return e.rule, None


def _pixel_sums(batches, *, record: dict, column: str):
    """mapInArrow body of ``Images.fit``: per-channel sums of pixel values and their squares, as
    exact integers (the total does not depend on how Spark split the rows), with the pixel count
    and the stored bytes."""
    import pyarrow as pa

    channels = int(record["channels"])
    sums, squares = [0] * channels, [0] * channels
    pixels = size = images = 0
    decode = decoder(record)
    for batch in batches:
        for value in batch.column(batch.schema.get_field_index(column)).to_pylist():
            array = decode(value).reshape(channels, -1).astype(np.int64)
            for c in range(channels):
                sums[c] += int(array[c].sum())
                squares[c] += int((array[c] * array[c]).sum())
            pixels += array.shape[1]
            size += len(value)
            images += 1
    yield pa.RecordBatch.from_pylist([{"sums": sums, "squares": squares, "pixels": pixels, "bytes": size,
                                       "images": images}])


def channel_stats(parts: list, channels: int) -> dict:
    """The manifest's ``mean``, ``std`` (of pixel/255, per channel) and ``row_bytes`` from the
    sample's partial sums; std 1 where a channel is constant (nothing to scale)."""
    sums, squares = [0] * channels, [0] * channels
    pixels = size = images = 0
    for p in parts:
        for c in range(channels):
            sums[c] += int(p["sums"][c])
            squares[c] += int(p["squares"][c])
        pixels, size, images = pixels + int(p["pixels"]), size + int(p["bytes"]), images + int(p["images"])
    if not pixels:
        return {"mean": [0.0] * channels, "std": [1.0] * channels, "row_bytes": 0}
    mean = [s / pixels / 255.0 for s in sums]
    var = [max(sq / pixels / 255.0 ** 2 - m * m, 0.0) for sq, m in zip(squares, mean)]
    std = [math.sqrt(v) if v > 1e-12 else 1.0 for v in var]
    return {"mean": [round(m, 6) for m in mean], "std": [round(s, 6) for s in std],
            "row_bytes": int(round(size / images))}


__all__ = ["ImageColumn", "Images", "check_column", "channel_stats", "image_size"]
