"""The one image decode (common/images.py) on real files Pillow wrote: what every odd file a folder
holds becomes, which are refused and why, and that a header claiming too many pixels is refused
before anything is decoded; and the images kind's records, config and batch entry."""

from __future__ import annotations

import io
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from common.config import ConfigError
from common.errors import DatasetError
from common.features import KINDS, FeatureSpec
from common.features.images import Images, channel_stats
from common.images import ImageRejected, decode_image, decoder, encode_image, image_size, stored_image
from common.rows import frame_refusals

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import image_files as files  # noqa: E402


def rejected(data: bytes, **kwargs) -> str:
    with pytest.raises(ImageRejected) as caught:
        decode_image(data, kwargs.pop("size", (16, 16)), kwargs.pop("channels", 3), **kwargs)
    return caught.value.rule


def test_png_and_jpeg_decode_to_uint8_channels_first_of_the_configured_size():
    pixels = files.class_pixels(1, 0, 24)
    for data in (files.png(pixels), files.jpeg(pixels, quality=95)):
        out = decode_image(data, (16, 12), 3, "stretch")
        assert out.dtype == np.uint8 and out.shape == (3, 16, 12) and out.flags.c_contiguous
    same = decode_image(files.png(pixels), (24, 24), 3)
    assert np.array_equal(same, pixels.transpose(2, 0, 1))  # at its own size: the pixels themselves


def test_the_bad_files_of_a_folder_are_refused_with_their_rule():
    assert rejected(files.truncated_jpeg()) == "undecodable_image"
    assert rejected(files.text_named_jpg()) == "undecodable_image"
    assert rejected(b"") == "undecodable_image"
    assert rejected(None) == "null_image"


def test_a_header_claiming_too_many_pixels_is_refused_before_decoding():
    bomb = files.huge_header_png()  # 100,000 x 100,000 claimed, 30 GB as RGB, in a few dozen bytes
    assert len(bomb) < 200
    assert rejected(bomb) == "image_too_large"
    # 9,000 x 9,000 (243 MB as RGB) is over the default max_pixels (50M): refused from the header;
    # allowed, the decode itself finds the few bytes of data are not that image.
    claim = files.huge_header_png(9_000)
    assert image_size(claim, max_pixels=10**8) == (9_000, 9_000)
    assert rejected(claim) == "image_too_large"
    assert rejected(claim, max_pixels=10**8) == "undecodable_image"
    # Our own ceiling, on a real image well under Pillow's: the same rule, decodable above it.
    small = files.png(files.class_pixels(0, 1, 24))
    assert rejected(small, max_pixels=24 * 24 - 1) == "image_too_large"
    assert decode_image(small, (16, 16), 3, max_pixels=24 * 24).shape == (3, 16, 16)


def test_a_one_pixel_image_is_taken_and_resized():
    out = decode_image(files.one_pixel_png(), (8, 8), 3, "crop")
    assert out.shape == (3, 8, 8)
    assert out[:, 0, 0].tolist() == [200, 10, 10] and (out == out[:, :1, :1]).all()


def test_a_16_bit_png_is_scaled_to_8_bits_not_clipped():
    out = decode_image(files.sixteen_bit_png(20), (20, 20), 1, "stretch")
    row = out[0, 0]
    assert row[0] == 0 and row[-1] == 255
    assert np.all(np.diff(row.astype(int)) > 0)  # a ramp stays a ramp (clipping would saturate at 255)


def test_a_cmyk_jpeg_becomes_rgb():
    out = decode_image(files.cmyk_jpeg(), (16, 16), 3)
    red, green, blue = out.reshape(3, -1).mean(axis=1)
    assert red < 40 and green > 215 and blue > 215  # cyan


def test_grayscale_into_three_channels_and_rgb_into_one():
    gray = decode_image(files.gray_png(value=77), (8, 8), 3)
    assert gray.shape == (3, 8, 8) and (gray == 77).all()
    rgb = files.png(np.full((8, 8, 3), (255, 0, 0), dtype=np.uint8))
    luma = decode_image(rgb, (8, 8), 1)
    assert luma.shape == (1, 8, 8) and (luma == 76).all()  # ITU-R 601-2: 0.299 * 255


def test_palette_alpha_is_composited_on_white():
    out = decode_image(files.palette_alpha_png(20), (20, 20), 3, "stretch")
    assert out[:, 10, 0].tolist() == [255, 255, 255]  # transparent half: white
    assert out[:, 10, -1].tolist() == [255, 0, 0]  # opaque half: red


def test_exif_orientation_is_applied():
    stored = Image.open(io.BytesIO(files.exif_rotated_jpeg(30, 20)))
    assert stored.size == (30, 20)  # landscape as stored
    out = decode_image(files.exif_rotated_jpeg(30, 20), (30, 20), 1, "stretch")  # [H, W]: portrait shown upright
    assert out[0, :5].mean() < 30 and out[0, -5:].mean() > 225  # black on top, white below


@pytest.mark.parametrize("resize", ["crop", "pad", "stretch"])
def test_resize_modes_give_the_size_and_differ_where_the_aspect_differs(resize):
    wide = np.zeros((10, 40, 3), dtype=np.uint8)
    wide[:, :10] = 255  # the left quarter white
    out = decode_image(files.png(wide), (10, 10), 3, resize)
    assert out.shape == (3, 10, 10)
    if resize == "crop":
        assert (out == 0).all()  # the center holds no white
    elif resize == "pad":
        assert (out[:, :3] == 0).all() and (out[:, 4:6, :2] > 200).all()  # black bands above and below
    else:
        assert (out[:, :, :2] > 200).all()


def test_encode_is_deterministic_and_png_round_trips_exactly():
    pixels = decode_image(files.jpeg(files.class_pixels(2, 3, 24)), (16, 16), 3)
    assert encode_image(pixels, "png") == encode_image(pixels, "png")
    assert encode_image(pixels, "jpeg", 90) == encode_image(pixels, "jpeg", 90)
    assert np.array_equal(decode_image(encode_image(pixels, "png"), (16, 16), 3), pixels)
    gray = pixels[:1]
    assert np.array_equal(decode_image(encode_image(gray, "png"), (16, 16), 1), gray)
    with pytest.raises(ValueError, match="uint8"):
        encode_image(pixels.astype(np.float32), "png")


def test_stored_image_keeps_the_original_bytes_or_re_encodes_at_size():
    original = files.jpeg(files.class_pixels(0, 4, 32))
    kept, pixels = stored_image(original, (16, 16), 3, "crop", "keep", 90, 10**6)
    assert kept == original and pixels.shape == (3, 16, 16)
    png_bytes, _ = stored_image(original, (16, 16), 3, "crop", "png", 90, 10**6)
    assert Image.open(io.BytesIO(png_bytes)).size == (16, 16)
    assert np.array_equal(decode_image(png_bytes, (16, 16), 3), pixels)  # what a rank decodes: the checked pixels
    with pytest.raises(ImageRejected):
        stored_image(files.truncated_jpeg(), (16, 16), 3, "crop", "png", 90, 10**6)


def record(**kw) -> dict:
    base = {"name": "photo", "kind": "images", "size": [16, 12], "channels": 3, "resize": "crop", "format": "png",
            "quality": 90, "max_pixels": 10**6, "mean": [0.5, 0.4, 0.3], "std": [0.2, 0.2, 0.2]}
    return {**base, **kw}


def test_the_kind_is_registered_and_its_batch_entry_decodes_stored_bytes():
    assert Images in KINDS
    spec = FeatureSpec([record()])
    (entry,) = [e for e in spec.batch_layout() if e.decode is not None]
    assert (entry.key, entry.columns, entry.dtype, entry.shape) == ("photo", ("photo",), "uint8", (3, 16, 12))
    decode = pickle.loads(pickle.dumps(entry.decode))  # shipped to rank processes
    data = files.png(files.class_pixels(1, 1, 24))
    assert np.array_equal(decode(data), decode_image(data, (16, 12), 3))
    assert spec.stored_columns() == [{"name": "photo", "dtype": "binary", "shape": []}]
    assert spec.probe(2)["photo"].shape == (2, 3, 16, 12)
    assert "images photo 3x16x12" in spec.summary()


def test_serving_refuses_bad_bytes_with_their_reason_and_decodes_the_rest():
    import pyarrow as pa

    spec = FeatureSpec([record()])
    good = files.jpeg(files.class_pixels(2, 0, 24))
    frame = pa.table({"photo": pa.array([good, None, files.text_named_jpg(), files.huge_header_png()], pa.binary())})
    refusals = frame_refusals(frame, spec)
    assert refusals.reasons.tolist() == [None, "null_image:photo", "undecodable_image:photo",
                                         "image_too_large:photo"]
    batch = spec.transform(frame.slice(0, 1))
    assert batch["photo"].dtype == np.uint8
    assert np.array_equal(batch["photo"][0], decode_image(good, (16, 12), 3))


def test_a_record_without_what_readers_use_is_refused_naming_the_field():
    Images.check_record(record(), "manifest.json")
    with pytest.raises(DatasetError, match=r"images\[photo\]\.mean"):
        Images.check_record(record(mean=[0.5]), "manifest.json")
    with pytest.raises(DatasetError, match=r"images\[photo\]\.size"):
        Images.check_record(record(size=[16]), "manifest.json")
    with pytest.raises(DatasetError, match="std"):
        Images.check_record({k: v for k, v in record().items() if k != "std"}, "manifest.json")


def test_config_keys_are_checked_naming_the_key():
    from pipelines.shard_config import load_shard_config

    base = {"sources": {"pics": {"path": "/tmp/x", "format": "parquet"}}, "label": {"column": "y", "num_classes": 2},
            "split": {"key": "path"}, "output": {"path": "/tmp/out"}}
    cfg = load_shard_config(defaults={**base, "features": {"images": {"content": {"size": [32, 24]}}}})
    (rec,) = Images.configured(cfg.features)
    assert rec == {"name": "content", "size": [32, 24], "channels": 3, "resize": "crop", "format": "jpeg",
                   "quality": 90, "max_pixels": 50_000_000}
    with pytest.raises(ConfigError, match="size"):
        load_shard_config(defaults={**base, "features": {"images": {"content": {"size": [32]}}}})
    with pytest.raises(ConfigError, match="channels"):
        load_shard_config(defaults={**base, "features": {"images": {"content": {"size": [8, 8], "channels": 2}}}})
    with pytest.raises(ConfigError, match="size"):
        load_shard_config(defaults={**base, "features": {"images": {"content": {"channels": 3}}}})


def test_channel_stats_are_exact_whatever_the_partial_sums():
    whole = {"sums": [255 * 4, 0], "squares": [255 * 255 * 4, 0], "pixels": 8, "bytes": 80, "images": 2}
    halves = [{"sums": [255 * 4, 0], "squares": [255 * 255 * 4, 0], "pixels": 4, "bytes": 30, "images": 1},
              {"sums": [0, 0], "squares": [0, 0], "pixels": 4, "bytes": 50, "images": 1}]
    assert channel_stats([whole], 2) == channel_stats(halves, 2)
    stats = channel_stats([whole], 2)
    assert stats["mean"] == [0.5, 0.0] and stats["std"] == [0.5, 1.0] and stats["row_bytes"] == 40
