"""The rank loader's decode stage: batches whose entries are still encoded (an image feature's stored
bytes, ``BatchEntry.decode`` set by its kind) -> the same batches with those entries decoded, and
on the train split augmented, by ``data.decode_workers`` threads.

Where it sits: the reader and the shuffle buffers (``training.shuffle_buffers``) move and shuffle
the encoded bytes, a tenth of a byte a pixel for a JPEG, so a buffer of ``shuffle_buffer_rows``
rows costs its encoded size (and ``data.shuffle_buffer_bytes`` caps that); each batch is decoded
here just before the step takes it, into uint8 [B, C, H, W] (normalisation is the network's, on
the device: ``training.image_stems``). ``ahead`` batches are decoded ahead of the one the step
trains on, so the memory of decoded images is ``(ahead + 1) x B x C x H x W`` bytes, whatever the
dataset's size.

Threads, not processes: the decode (Pillow, or the kind's own decoder) and the resize release the
GIL for the pixels' work, and a thread writes its rows straight into the batch's array, with no
copy between processes (benchmarks/image_loader.py measured how they scale; RESULTS.md). A
batch's rows are dealt to the workers in contiguous chunks, so one batch uses every worker.

Augmentation (``data.augment.<column>``: ``AugmentConfig``) happens on uint8 after decoding, on
the train split only. Each row's draws come from its own generator, seeded by (``train.seed``,
epoch, the row's ``_row``, the column's position): whatever thread decodes a row and whatever
batch it lands in, it gets the same crop, flip and jitter, so a resumed run and a Horovod run
see the bytes a torch.distributed run sees.

It opens no file and imports neither torch nor Spark; Pillow is imported by the augmentation only
(the kind's decode imports what it uses).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from common.config import require, setting
from common.dataset import ROW_INDEX
from common.errors import ConfigError, DatasetError


@dataclass
class RandomResizedCropConfig:
    scale: list[float] = setting("the crop's share of the image's area, drawn uniformly in [low, high] (0 < low <= "
                                 "high <= 1)", default_factory=lambda: [0.08, 1.0])
    ratio: list[float] = setting("the crop's aspect ratio (width / height), drawn log-uniformly in [low, high]",
                                 default_factory=lambda: [3 / 4, 4 / 3])

    def __post_init__(self):
        require(len(self.scale) == 2 and 0 < self.scale[0] <= self.scale[1] <= 1, "scale",
                f"must be [low, high] with 0 < low <= high <= 1, got {self.scale}")
        require(len(self.ratio) == 2 and 0 < self.ratio[0] <= self.ratio[1], "ratio",
                f"must be [low, high] with 0 < low <= high, got {self.ratio}")


@dataclass
class AugmentConfig:
    """One image column's augmentation on the train split (``data.augment.<column>``), on uint8
    after decoding, each row's draws seeded by (train.seed, epoch, its _row)."""

    random_resized_crop: RandomResizedCropConfig | None = setting(
        "a random crop of the image resized back to its size (bilinear), as `{scale: [0.5, 1.0]}`; null: none",
        default=None)
    flip: bool = setting("flip half the rows left to right", default=False)
    color_jitter: float = setting("scale brightness, contrast and saturation (3 channels) each by a factor drawn in "
                                  "[1 - j, 1 + j]; 0: none", default=0.0)

    def __post_init__(self):
        require(0 <= self.color_jitter < 1, "color_jitter", f"must be in [0, 1), got {self.color_jitter}")


@dataclass(frozen=True)
class ImageAugment:
    """One image column's augmentation as plain values (from ``data.augment.<column>``)."""

    crop_scale: tuple[float, float] | None = None  # random_resized_crop's area fraction; None: no crop
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)  # its aspect ratios (width / height), drawn log-uniformly
    flip: bool = False  # a horizontal flip, half the rows
    color_jitter: float = 0.0  # brightness, contrast and saturation each scaled by a factor in [1 - j, 1 + j]

    @classmethod
    def from_config(cls, cfg) -> "ImageAugment | None":
        """From an ``AugmentConfig`` (None: no augmentation)."""
        if cfg is None:
            return None
        crop = cfg.random_resized_crop
        return cls(crop_scale=tuple(crop.scale) if crop else None, crop_ratio=tuple(crop.ratio) if crop else (3 / 4, 4 / 3),
                   flip=cfg.flip, color_jitter=cfg.color_jitter)


def row_generator(seed: int, epoch: int, row: int, column: int) -> np.random.Generator:
    """The draws of one row's augmentation of one column: a pure function of its arguments."""
    return np.random.default_rng([seed, epoch, row, column])


def augmented(image: np.ndarray, augment: ImageAugment, rng: np.random.Generator) -> np.ndarray:
    """``image`` (uint8 [C, H, W]) cropped and resized back, flipped and jittered as ``augment`` says,
    by ``rng``'s draws, always in this order and always the same number of them (so a row's flip
    does not depend on whether its crop was drawn from a narrow image).

    All on one Pillow image (C code that releases the GIL, so decode threads scale): the crop's box
    resized back bilinear in one pass, the flip, and the jitter (``_jittered``)."""
    from PIL import Image

    channels, height, width = image.shape
    draws = rng.random(5)
    factors = 1 + augment.color_jitter * (2 * rng.random(3) - 1) if augment.color_jitter else None
    box = (_crop_box(height, width, augment.crop_scale, augment.crop_ratio, draws[:4])
           if augment.crop_scale is not None else (0, 0, width, height))
    flip = augment.flip and draws[4] < 0.5
    if box == (0, 0, width, height) and not flip and factors is None:
        return image
    # Plane by plane: merging and splitting contiguous planes costs a third of transposing [C, H, W].
    im = Image.fromarray(image[0]) if channels == 1 else Image.merge("RGB", [Image.fromarray(p) for p in image])
    if box != (0, 0, width, height):
        im = im.resize((width, height), Image.Resampling.BILINEAR, box=box)
    if flip:
        im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    if factors is not None:
        im = _jittered(im, factors, channels)
    return np.stack([np.asarray(plane) for plane in im.split()])


def _jittered(im, factors: np.ndarray, channels: int):
    """Brightness, contrast and (3 channels) saturation scaled by ``factors``, as torchvision's
    ColorJitter and Pillow's ImageEnhance blend them (with black, the image's mean gray, its
    grayscale), brightness and contrast as one 256-entry table (one pass; rounded once, so no clip
    between them), saturation as one blend with the grayscale."""
    from PIL import Image

    brightness, contrast, saturation = (float(f) for f in factors)
    histogram = np.asarray(im.convert("L").histogram(), dtype=np.float64)
    mean = brightness * float(histogram @ np.arange(256)) / max(1.0, histogram.sum())
    table = np.clip(np.rint(contrast * brightness * np.arange(256) + (1 - contrast) * mean), 0, 255).astype(np.uint8)
    im = im.point(table.tolist() * channels)
    if channels == 3:
        im = Image.blend(im.convert("L").convert("RGB"), im, saturation)
    return im


def _crop_box(height: int, width: int, scale: tuple[float, float], ratio: tuple[float, float],
              draws: np.ndarray) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of a random crop of ``scale`` of the area and ``ratio`` aspect,
    as torchvision's RandomResizedCrop draws it, from four uniform draws (one try; a crop that
    does not fit is clipped to the image rather than drawn again, so the draws stay four)."""
    area = height * width * (scale[0] + (scale[1] - scale[0]) * draws[0])
    log_lo, log_hi = np.log(ratio[0]), np.log(ratio[1])
    aspect = float(np.exp(log_lo + (log_hi - log_lo) * draws[1]))
    crop_w = int(min(width, max(1, round(np.sqrt(area * aspect)))))
    crop_h = int(min(height, max(1, round(np.sqrt(area / aspect)))))
    left = int(draws[2] * (width - crop_w + 1))
    top = int(draws[3] * (height - crop_h + 1))
    return left, top, left + crop_w, top + crop_h


class DecodeStage:
    """Decodes (and augments) a loader's encoded batch entries: ``stage.batches(batches, epoch)``.

    ``entries``: the batch entries whose ``decode`` is set; ``augments``: by entry key, on the train
    split (None or missing: none); ``workers``: decode threads; ``ahead``: batches decoded ahead.
    """

    def __init__(self, entries: list, workers: int, augments: dict[str, ImageAugment | None] | None = None,
                 seed: int = 0, ahead: int = 2):
        self.entries = encoded_entries(entries)
        self.workers, self.ahead, self.seed = max(1, workers), max(1, ahead), seed
        self.augments = {key: a for key, a in (augments or {}).items() if a is not None}

    def batches(self, batches: Iterator[dict], epoch: int, augment: bool, skip: int = 0) -> Iterator[dict]:
        """``batches`` with the encoded entries decoded, in order; the first ``skip`` pass through
        as they are (a resume reads but does not use them). ``augment``: the train split's."""
        if not self.entries:
            yield from batches
            return
        pending: list[tuple[dict, list[Future]]] = []
        with ThreadPoolExecutor(self.workers, thread_name_prefix="decode") as pool:
            try:
                for index, batch in enumerate(batches):
                    if index < skip:
                        yield batch
                        continue
                    pending.append(self._submit(pool, batch, epoch, augment))
                    if len(pending) > self.ahead:
                        yield self._done(*pending.pop(0))
                while pending:
                    yield self._done(*pending.pop(0))
            finally:
                for _, futures in pending:
                    for future in futures:
                        future.cancel()

    def decode_batch(self, batch: dict, epoch: int = 0, augment: bool = False) -> dict:
        """One batch, decoded in this thread (serving-sized work, tests)."""
        out = dict(batch)
        for key, (values, target, job) in self._jobs(batch, epoch, augment).items():
            job(0, len(values))
            out[key] = target
        return out

    def _submit(self, pool: ThreadPoolExecutor, batch: dict, epoch: int, augment: bool) -> tuple[dict, list[Future]]:
        out, futures = dict(batch), []
        for key, (values, target, job) in self._jobs(batch, epoch, augment).items():
            rows = len(values)
            step = -(-rows // self.workers) if rows else 1
            futures += [pool.submit(job, start, min(rows, start + step)) for start in range(0, rows, step)]
            out[key] = target
        return out, futures

    @staticmethod
    def _done(batch: dict, futures: list[Future]) -> dict:
        for future in futures:
            future.result()  # a decode error is raised here, in the loader's thread
        return batch

    def _jobs(self, batch: dict, epoch: int, augment: bool) -> dict[str, tuple[np.ndarray, np.ndarray, Callable]]:
        """Per encoded entry: its values, the uint8 array its rows are decoded into, and the job that
        decodes rows [start, stop) into it."""
        jobs = {}
        rows = batch[ROW_INDEX]
        for column, entry in enumerate(self.entries):
            values = batch[entry.key]
            target = np.empty((len(values), *entry.shape), dtype=entry.dtype)
            augment_with = self.augments.get(entry.key) if augment else None
            jobs[entry.key] = (values, target, _row_decoder(entry, values, target, rows, augment_with,
                                                             self.seed, epoch, column))
        return jobs


def _row_decoder(entry, values: np.ndarray, target: np.ndarray, rows: np.ndarray,
                 augment: ImageAugment | None, seed: int, epoch: int, column: int) -> Callable[[int, int], None]:
    def job(start: int, stop: int) -> None:
        for i in range(start, stop):
            try:
                image = entry.decode(values[i])
            except Exception as exc:  # noqa: BLE001 - the shard job checked every image: the file is damaged
                raise DatasetError(f"column {entry.columns[0]!r}, row {int(rows[i])}: the stored value could not be "
                                   f"decoded ({type(exc).__name__}: {exc}); the dataset is damaged, re-run the "
                                   "shard job") from exc
            if augment is not None:
                image = augmented(image, augment, row_generator(seed, epoch, int(rows[i]), column))
            target[i] = image
    return job


def check_augment(augment: dict, entries) -> None:
    """Exit 2 naming ``data.augment.<column>`` where the column is not one of the dataset's encoded
    (image) batch entries ``entries``."""
    images = [e.key for e in encoded_entries(entries)]
    for column in augment:
        if column not in images:
            raise ConfigError(f"data.augment.{column}: the dataset has no image column {column!r} (its image "
                              f"columns: {images or 'none'}); augment an image column, or remove the key")


def encoded_entries(entries) -> list:
    """The batch entries a loader must decode (their ``decode`` is set)."""
    return [e for e in entries if e.decode is not None]


__all__ = ["AugmentConfig", "DecodeStage", "ImageAugment", "RandomResizedCropConfig", "augmented", "check_augment",
           "encoded_entries", "row_generator"]
