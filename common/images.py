"""The one image decode: encoded bytes (JPEG, PNG, anything Pillow reads) to a uint8 [C, H, W]
array of the configured size, shared by the shard job's row check, the ranks' decode stage and
serving, so every stage sees the same pixels for the same bytes.

``decode_image`` reads the header first and refuses an image of more than ``max_pixels`` pixels
before any pixel is decoded (a decompression bomb is never decoded), then applies the EXIF
orientation, converts the mode (16-bit, palette, CMYK, grayscale or RGB) to ``channels``
(alpha composited on white) and resizes (``crop``: cover then center-crop; ``pad``: contain then
pad with black; ``stretch``: both sides to size). A file it cannot take raises ``ImageRejected``
with the rule a quarantine reason names (``undecodable_image``, ``image_too_large``,
``null_image``). ``encode_image`` stores an array as JPEG or PNG (deterministic bytes).

Pure functions on Pillow and numpy: no Spark, no torch (executors, ranks and the driver import it).
Pillow releases the GIL while it decodes, so threads scale.
"""

from __future__ import annotations

import io
from functools import partial
from typing import Callable

import numpy as np

RESIZE_MODES = ("crop", "pad", "stretch")
FORMATS = ("jpeg", "png", "keep")
DEFAULT_MAX_PIXELS = 50_000_000
NULL_IMAGE, UNDECODABLE_IMAGE, IMAGE_TOO_LARGE = "null_image", "undecodable_image", "image_too_large"
RULES = (NULL_IMAGE, UNDECODABLE_IMAGE, IMAGE_TOO_LARGE)  # in the order a row is checked
_WHITE = (255, 255, 255, 255)


class ImageRejected(ValueError):
    """An image a stage cannot take: ``rule`` is the quarantine reason's rule (``RULES``)."""

    def __init__(self, rule: str, detail: str = ""):
        super().__init__(f"{rule}: {detail}" if detail else rule)
        self.rule = rule


def _opened(data: bytes, max_pixels: int):
    """The image's header parsed (no pixel decoded yet); ImageRejected when it is not an image or
    claims more than ``max_pixels`` pixels."""
    from PIL import Image

    if data is None:
        raise ImageRejected(NULL_IMAGE, "no bytes")
    try:
        im = Image.open(io.BytesIO(bytes(data)))
    except Image.DecompressionBombError as e:  # Pillow's own ceiling, far above ours by default
        raise ImageRejected(IMAGE_TOO_LARGE, str(e)) from None
    except Exception as e:  # UnidentifiedImageError, a corrupt header (SyntaxError, ValueError, OSError ...)
        raise ImageRejected(UNDECODABLE_IMAGE, f"{type(e).__name__}: {e}") from None
    width, height = im.size
    if width * height > max_pixels:
        raise ImageRejected(IMAGE_TOO_LARGE, f"{width} x {height} pixels is over max_pixels {max_pixels:,}")
    if width < 1 or height < 1:
        raise ImageRejected(UNDECODABLE_IMAGE, f"{width} x {height} pixels")
    return im


def image_size(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int]:
    """(width, height) from the header alone, as stored (before EXIF orientation)."""
    return _opened(data, max_pixels).size


def _eight_bit(im):
    """16-bit and 32-bit single-channel images (PNG's I;16, I) scaled to 8 bits, float clipped."""
    from PIL import Image

    if im.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N"):
        values = np.asarray(im).astype(np.int64)
        return Image.fromarray(np.clip((values + 128) // 257, 0, 255).astype(np.uint8), "L")
    if im.mode == "F":
        return Image.fromarray(np.clip(np.asarray(im), 0, 255).astype(np.uint8), "L")
    return im


def _flattened(im):
    """The image without alpha (composited on white) in L or RGB."""
    from PIL import Image

    im = _eight_bit(im)
    if im.mode == "P":
        im = im.convert("RGBA" if "transparency" in im.info else "RGB")
    if im.mode in ("PA", "LA", "La", "RGBa", "RGBA") or (im.mode in ("L", "RGB") and "transparency" in im.info):
        rgba = im.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, _WHITE), rgba).convert("RGB")
    if im.mode in ("L", "RGB"):
        return im
    return im.convert("RGB")  # CMYK, YCbCr, LAB, HSV, 1 (bilevel), ...


def _resized(im, size: tuple[int, int], resize: str):
    from PIL import Image, ImageOps

    height, width = size
    if im.size == (width, height):
        return im
    method = Image.Resampling.BILINEAR
    if resize == "stretch":
        return im.resize((width, height), method)
    if resize == "crop":
        return ImageOps.fit(im, (width, height), method)
    if resize == "pad":
        return ImageOps.pad(im, (width, height), method, color=0)
    raise ValueError(f"resize must be one of {RESIZE_MODES}, got {resize!r}")


def decode_image(data: bytes, size, channels: int, resize: str = "crop",
                 max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """Encoded image bytes -> uint8 [channels, H, W] (``size`` is [H, W]); ImageRejected when the
    bytes are no image Pillow decodes in full (truncated, text, an unsupported format) or the
    header claims more than ``max_pixels`` pixels (then nothing is decoded)."""
    from PIL import ImageOps

    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 or 3, got {channels!r}")
    size = (int(size[0]), int(size[1]))
    im = _opened(data, max_pixels)
    try:
        side = max(size)
        im.draft(None, (side, side))  # JPEG: decode at 1/2, 1/4 or 1/8 scale where that still covers size
        im.load()
        im = ImageOps.exif_transpose(im) if im.getexif().get(0x0112, 1) != 1 else im  # a copy only if rotated
        im = _flattened(im)
        target = "L" if channels == 1 else "RGB"
        if im.mode != target:  # convert() copies even to the same mode
            im = im.convert(target)
        im = _resized(im, size, resize)
        array = np.asarray(im, dtype=np.uint8)
    except ImageRejected:
        raise
    except Exception as e:  # truncated data (OSError), a broken stream, an EXIF block Pillow refuses
        raise ImageRejected(UNDECODABLE_IMAGE, f"{type(e).__name__}: {e}") from None
    if channels == 1:
        return np.ascontiguousarray(array.reshape(1, *size))
    return np.ascontiguousarray(array.transpose(2, 0, 1))


def encode_image(array: np.ndarray, format: str, quality: int = 90) -> bytes:
    """uint8 [C, H, W] (C 1 or 3) -> JPEG or PNG bytes; the same array always gives the same bytes."""
    from PIL import Image

    array = np.asarray(array)
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[0] not in (1, 3):
        raise ValueError(f"encode_image takes uint8 [C, H, W] with C 1 or 3, got {array.dtype} {array.shape}")
    im = Image.fromarray(array[0]) if array.shape[0] == 1 else Image.fromarray(np.ascontiguousarray(array.transpose(1, 2, 0)))
    out = io.BytesIO()
    if format == "jpeg":
        im.save(out, "JPEG", quality=int(quality))
    elif format == "png":
        im.save(out, "PNG", compress_level=6)
    else:
        raise ValueError(f"encode_image writes jpeg or png, got {format!r}")
    return out.getvalue()


def stored_image(data: bytes, size, channels: int, resize: str, format: str, quality: int,
                 max_pixels: int) -> tuple[bytes, np.ndarray]:
    """What the shard job stores for one raw image, and the pixels it checked: decoded once
    (ImageRejected as ``decode_image``), then re-encoded at size (``jpeg``/``png``) or the
    original bytes (``keep``). The pixels returned are what a rank decodes from the stored bytes
    with ``keep`` and ``png``; with ``jpeg``, before the JPEG round trip."""
    pixels = decode_image(data, size, channels, resize, max_pixels)
    if format == "keep":
        return bytes(data), pixels
    return encode_image(pixels, format, quality), pixels


def decoder(record: dict) -> Callable[[bytes], np.ndarray]:
    """The picklable decode of one stored value of an images manifest record (``BatchEntry.decode``)."""
    return partial(decode_image, size=tuple(record["size"]), channels=int(record["channels"]),
                   resize=record.get("resize", "crop"), max_pixels=int(record.get("max_pixels", DEFAULT_MAX_PIXELS)))


__all__ = ["DEFAULT_MAX_PIXELS", "FORMATS", "IMAGE_TOO_LARGE", "ImageRejected", "NULL_IMAGE", "RESIZE_MODES",
           "RULES", "UNDECODABLE_IMAGE", "decode_image", "decoder", "encode_image", "image_size", "stored_image"]
