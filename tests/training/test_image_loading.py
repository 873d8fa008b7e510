"""The rank loader on image columns (training/image_loading.py, training/data.py): the stored bytes
are shuffled encoded and decoded batch by batch into uint8 [B, C, H, W] exactly as common.images
decodes them, by any number of decode threads; augmentation is a function of (seed, epoch, _row)
alone, on the train split only, so a resumed epoch and any thread count give the same bytes; a
shuffle buffer stops at data.shuffle_buffer_bytes; a bad augment key is exit 2 naming it. Real
PNG and JPEG bytes written by Pillow (tests/image_files.py), read from real Parquet shards."""

from __future__ import annotations

import numpy as np
import pytest

from common.errors import ConfigError, DatasetError
from common.images import decode_image
from image_data import SIZE, write_image_dataset
from training.columns import columns_for
from training.data import RankLoader
from training.image_loading import DecodeStage, ImageAugment
from training.split_layout import SplitLayout

LAYOUT = {"train": [[40, 30], [50]], "val": [[20], [13]]}
AUGMENT = {"photo": ImageAugment(crop_scale=(0.5, 1.0), flip=True, color_jitter=0.2)}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_image_dataset(str(tmp_path_factory.mktemp("images") / "ds"), LAYOUT, numeric=True)


def _loader(dataset, split="train", **options):
    from common.dataset import read_manifest

    manifest = read_manifest(dataset.uri)
    options = {"seed": 3, "shuffle_buffer_rows": 64, "reader": "arrow", **options}
    return RankLoader(SplitLayout.from_manifest(manifest, split), columns_for(manifest), 0, 1, 16, **options)


def _numpy(batches) -> list[dict]:
    return [{key: value.numpy() for key, value in batch.items()} for batch in batches]


def _assert_same(a: list[dict], b: list[dict]):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)


@pytest.mark.stack  # a binary column of each pyarrow to numpy objects, shuffled and sliced
def test_each_row_is_decoded_as_common_images_decodes_it_whatever_the_decode_threads(dataset):
    one = _numpy(_loader(dataset, decode_workers=1).epoch(0))
    three = _numpy(_loader(dataset, decode_workers=3).epoch(0))
    _assert_same(one, three)
    raw = dataset.raw["train"]["photo"]
    assert len(one) == 120 // 16
    for batch in one:
        assert batch["photo"].dtype == np.uint8 and batch["photo"].shape == (16, 3, *SIZE)
        for row, image in zip(batch["_row"], batch["photo"]):
            np.testing.assert_array_equal(image, decode_image(raw[row], SIZE, 3))
    # Validation reads every row once, decoded the same way.
    rows = {int(r): image for b in _numpy(_loader(dataset, "val", shuffle=False).every_row())
            for r, image in zip(b["_row"], b["photo"])}
    assert sorted(rows) == list(range(33))
    np.testing.assert_array_equal(rows[32], decode_image(dataset.raw["val"]["photo"][32], SIZE, 3))


def test_augmentation_is_a_function_of_seed_epoch_and_row_on_the_train_split_only(dataset):
    straight = _numpy(_loader(dataset, decode_workers=1, augments=AUGMENT).epoch(0))
    # Any thread count, and a resume that skips the first 3 batches: the same bytes.
    _assert_same(straight, _numpy(_loader(dataset, decode_workers=3, augments=AUGMENT).epoch(0)))
    _assert_same(straight[3:], _numpy(_loader(dataset, decode_workers=2, augments=AUGMENT).epoch(0, skip_batches=3)))
    raw = dataset.raw["train"]["photo"]
    plain = {int(r): decode_image(raw[r], SIZE, 3) for b in straight for r in b["_row"]}
    augmented = {int(r): image for b in straight for r, image in zip(b["_row"], b["photo"])}
    assert sum(not np.array_equal(augmented[r], plain[r]) for r in plain) > 0.9 * len(plain)
    # Another epoch draws again: the same rows, other crops.
    again = {int(r): image for b in _numpy(_loader(dataset, augments=AUGMENT).epoch(1)) for r, image in zip(b["_row"], b["photo"])}
    assert sum(not np.array_equal(again[r], augmented[r]) for r in set(again) & set(augmented)) > 0.9 * len(again)
    # A flip alone: each row as decoded or mirrored, about half of each.
    flips = _numpy(_loader(dataset, augments={"photo": ImageAugment(flip=True)}).epoch(0))
    mirrored = [bool(np.array_equal(image, plain[int(r)][:, :, ::-1])) for b in flips for r, image in zip(b["_row"], b["photo"])]
    kept = [bool(np.array_equal(image, plain[int(r)])) for b in flips for r, image in zip(b["_row"], b["photo"])]
    assert all(m or k for m, k in zip(mirrored, kept)) and 0.3 < np.mean(mirrored) < 0.7
    # Validation never augments, even on a loader that was given augmentation.
    val = _numpy(_loader(dataset, "val", shuffle=False, augments=AUGMENT).every_row())
    for batch in val:
        for r, image in zip(batch["_row"], batch["photo"]):
            np.testing.assert_array_equal(image, decode_image(dataset.raw["val"]["photo"][r], SIZE, 3))


def test_a_shuffle_buffer_stops_at_shuffle_buffer_bytes_before_its_rows(dataset):
    import pyarrow.parquet as pq

    loader = _loader(dataset, shuffle_buffer_rows=64, shuffle_buffer_bytes=40 * 1024)
    table = pq.read_table(loader.files[0].uri.removeprefix("file://"), columns=loader.columns.stored)
    per_row = table.nbytes / table.num_rows
    buffers = list(loader.buffers.from_tables(iter([table]), np.random.default_rng(0)))
    sizes = [len(b.arrays["_row"]) for b in buffers]
    assert max(sizes) == int(40 * 1024 // per_row) > 16 and max(sizes) < 64  # the bytes ended them, not the rows
    assert sum(sizes) - sum(len(b.rest["_row"]) for b in buffers[:-1] if b.rest) == table.num_rows
    # Never fewer rows than one batch, however small the bound.
    small = list(_loader(dataset, shuffle_buffer_bytes=1).buffers.from_tables(iter([table]), np.random.default_rng(0)))
    assert min(b.full for b in small[:-1]) == 16


def test_a_stored_image_that_no_longer_decodes_names_its_column_and_row(dataset):
    from common.dataset import read_manifest

    stage = DecodeStage(list(columns_for(read_manifest(dataset.uri)).features), workers=2)
    batch = {"photo": np.array([dataset.raw["train"]["photo"][0], b"not an image"], dtype=object),
             "_row": np.array([0, 7])}
    with pytest.raises(DatasetError, match=r"column 'photo', row 7: the stored value could not be decoded"):
        list(stage.batches(iter([batch]), epoch=0, augment=False))


def test_augmenting_a_column_that_is_not_an_image_column_is_exit_2_naming_the_key(dataset, tmp_path):
    from common.dataset import read_manifest
    from train_configs import train_config
    from training.plan import build_plan

    cfg = train_config(dataset, tmp_path / "model", "data.augment.x1.flip=true")
    with pytest.raises(ConfigError, match=r"^data\.augment\.x1: the dataset has no image column 'x1' \(its image "
                                          r"columns: \['photo'\]\)") as err:
        build_plan(cfg, read_manifest(dataset.uri))
    assert err.value.exit_code == 2
