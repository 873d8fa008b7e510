"""Real image files written by Pillow for the image tests (unit tests of common/images.py, the shard
job through ``binaryFile``, serving, the ranks' decode stage): tiny class-folder images, and each
odd or bad file a user's folder holds. Every function returns bytes; ``write_image_folder`` puts a
whole folder on disk and says what each file is."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image

CLASSES = ("cat", "dog", "fox")


def _encoded(im: Image.Image, fmt: str, **kwargs) -> bytes:
    out = io.BytesIO()
    im.save(out, fmt, **kwargs)
    return out.getvalue()


def class_pixels(label: int, index: int, size: int = 24) -> np.ndarray:
    """A size x size RGB picture that differs by class (a bright channel per class) and by index."""
    rng = np.random.default_rng(1000 * label + index)
    pixels = rng.integers(0, 96, size=(size, size, 3), dtype=np.uint8)
    pixels[..., label % 3] += 150
    return pixels


def png(pixels: np.ndarray) -> bytes:
    return _encoded(Image.fromarray(pixels), "PNG")


def jpeg(pixels: np.ndarray, quality: int = 90) -> bytes:
    return _encoded(Image.fromarray(pixels), "JPEG", quality=quality)


def truncated_jpeg() -> bytes:
    whole = jpeg(class_pixels(0, 999, 32))
    return whole[: len(whole) // 2]


def text_named_jpg() -> bytes:
    return b"this is a text file that someone named photo.jpg\n" * 4


def one_pixel_png() -> bytes:
    return png(np.array([[[200, 10, 10]]], dtype=np.uint8))


def sixteen_bit_png(size: int = 20) -> bytes:
    """A grayscale ramp in 16 bits (Pillow mode I;16): 0 .. 65535 left to right."""
    ramp = np.tile(np.linspace(0, 65535, size).astype(np.uint16), (size, 1))
    return _encoded(Image.fromarray(ramp), "PNG")


def cmyk_jpeg(size: int = 20) -> bytes:
    """Pure cyan in CMYK (the colour a print workflow writes)."""
    im = Image.new("CMYK", (size, size), (255, 0, 0, 0))
    return _encoded(im, "JPEG", quality=95)


def gray_png(size: int = 20, value: int = 77) -> bytes:
    return _encoded(Image.new("L", (size, size), value), "PNG")


def palette_alpha_png(size: int = 20) -> bytes:
    """A palette PNG whose left half is transparent (composited on white) and right half opaque red."""
    im = Image.new("P", (size, size), 1)
    im.putpalette([0, 0, 0, 255, 0, 0] + [0] * (254 * 3))
    for x in range(size // 2):
        for y in range(size):
            im.putpixel((x, y), 0)
    im.info["transparency"] = 0
    return _encoded(im, "PNG", transparency=0)


def exif_rotated_jpeg(width: int = 30, height: int = 20) -> bytes:
    """A landscape JPEG (left half black, right half white) tagged orientation 6 (rotate 90 clockwise
    to display): shown upright it is portrait, black on top."""
    pixels = np.zeros((height, width, 3), dtype=np.uint8)
    pixels[:, width // 2:] = 255
    exif = Image.Exif()
    exif[0x0112] = 6
    return _encoded(Image.fromarray(pixels), "JPEG", quality=95, exif=exif)


def huge_header_png(side: int = 100_000) -> bytes:
    """A PNG whose header claims side x side pixels, followed by a few bytes of data: decoding it
    would need 30 GB; only its header may be read."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
            + chunk(b"IEND", b""))


# The odd files a folder holds: (file name, bytes, the quarantine rule or None where it is taken).
def odd_files() -> list[tuple[str, bytes, str | None]]:
    return [("truncated.jpg", truncated_jpeg(), "undecodable_image"),
            ("notes.jpg", text_named_jpg(), "undecodable_image"),
            ("bomb.png", huge_header_png(), "image_too_large"),
            ("tiny.png", one_pixel_png(), None),
            ("deep.png", sixteen_bit_png(), None),
            ("print.jpg", cmyk_jpeg(), None),
            ("gray.png", gray_png(), None),
            ("palette.png", palette_alpha_png(), None),
            ("rotated.jpg", exif_rotated_jpeg(), None)]


def write_image_folder(root: Path, per_class: int = 24, size: int = 24) -> dict[str, str | None]:
    """``root/<class>/<n>.png|jpg``: ``per_class`` images per class of CLASSES (PNG and JPEG
    alternating), and the odd files under ``root/cat/``. Returns {file path: the rule it is
    quarantined for, None where taken}."""
    expected: dict[str, str | None] = {}
    for label, name in enumerate(CLASSES):
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = class_pixels(label, i, size)
            path = folder / (f"{i:03d}.png" if i % 2 else f"{i:03d}.jpg")
            path.write_bytes(png(pixels) if i % 2 else jpeg(pixels))
            expected[str(path)] = None
    for file_name, data, rule in odd_files():
        path = root / CLASSES[0] / file_name
        path.write_bytes(data)
        expected[str(path)] = rule
    (root / "LICENSE.txt").write_text("not an image: a source's pathGlobFilter leaves it out\n")
    return expected
