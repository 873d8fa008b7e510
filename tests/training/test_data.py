"""The loader's promises, checked without Horovod: every rank gets the same number of full
batches for any layout, no row twice in an epoch, fewer than W x B x accum rows skipped, a
reproducible per-epoch order (so (epoch, step) is a resume position), and arrays equal to what
FeatureSpec.transform makes of the raw rows."""

import itertools
import threading

import numpy as np
import pytest

from common.dataset import read_manifest
from tabular_data import write_dataset
from training.columns import columns_for
from training.data import RankLoader, read_first_rows
from training.epoch_steps import rank_row_range, skipped_rows_per_epoch, steps_per_epoch
from training.split_layout import SplitLayout

UNEVEN = {"train": [[300, 77], [13], [500, 111, 2], [0], [250]], "val": [[90], [33]]}


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    ds = write_dataset(str(tmp_path_factory.mktemp("data") / "ds"), UNEVEN, array_shape=(2, 3))
    return ds, read_manifest(ds.uri)


def test_arithmetic_for_many_sizes():
    for total, world, batch, accum in itertools.product([1, 7, 100, 1003, 4096], [1, 2, 3, 5], [1, 8, 32], [1, 2]):
        ranges = [rank_row_range(total, r, world) for r in range(world)]
        assert ranges[0][0] == 0 and ranges[-1][1] == total
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, disjoint
        steps = steps_per_epoch(total, world, batch, accum)
        assert all(hi - lo >= steps * batch * accum for lo, hi in ranges)  # every rank can fill its steps
        skipped = skipped_rows_per_epoch(total, world, batch, accum)
        assert 0 <= skipped < world * batch * accum or steps == 0


def _epoch_rows(manifest, world, batch, accum=1, epoch=0, seed=3, buffer=100):
    layout = SplitLayout.from_manifest(manifest, "train")
    per_rank = []
    for rank in range(world):
        loader = RankLoader(layout, columns_for(manifest), rank, world, batch, accum, seed=seed,
                            shuffle_buffer_rows=buffer)
        batches = list(loader.epoch(epoch))
        assert len(batches) == loader.batches_per_epoch
        assert all(len(b["label"]) == batch for b in batches)
        stats = loader.stats[-1]
        assert stats.duplicate_rows == 0 and stats.batches == len(batches)
        per_rank.append(np.concatenate([b["_row"].numpy() for b in batches]))
    return layout, per_rank


@pytest.mark.parametrize("world, batch, accum", [(1, 32, 1), (2, 32, 1), (3, 16, 2), (3, 50, 1), (4, 7, 3)])
def test_equal_batches_no_repeats_bounded_skips(uneven, world, batch, accum):
    _, manifest = uneven
    layout, per_rank = _epoch_rows(manifest, world, batch, accum)
    counts = {len(rows) for rows in per_rank}
    assert len(counts) == 1  # the same number of rows (so steps) on every rank
    everything = np.concatenate(per_rank)
    assert len(np.unique(everything)) == len(everything)  # no row twice in the epoch, across ranks
    skipped = layout.rows - len(everything)
    assert skipped == skipped_rows_per_epoch(layout.rows, world, batch, accum) < world * batch * accum
    for rank, rows in enumerate(per_rank):
        lo, hi = rank_row_range(layout.rows, rank, world)
        assert rows.min() >= lo and rows.max() < hi


@pytest.mark.parametrize("world, batch", [(1, 32), (2, 32), (3, 50), (4, 7)])
def test_every_row_yields_each_row_once_with_a_partial_last_batch(uneven, world, batch):
    """Validation's pass: all of a split's rows across the ranks, none skipped, none twice."""
    _, manifest = uneven
    layout = SplitLayout.from_manifest(manifest, "val")
    per_rank = []
    for rank in range(world):
        loader = RankLoader(layout, columns_for(manifest), rank, world, batch, shuffle=False, shuffle_buffer_rows=16)
        sizes = [len(b["label"]) for b in loader.every_row()]
        lo, hi = rank_row_range(layout.rows, rank, world)
        assert sum(sizes) == hi - lo and all(size == batch for size in sizes[:-1]) and 0 < sizes[-1] <= batch
        per_rank.append(np.concatenate([b["_row"].numpy() for b in loader.every_row()]))
    np.testing.assert_array_equal(np.sort(np.concatenate(per_rank)), np.arange(layout.rows))


def test_order_is_a_function_of_seed_and_epoch(uneven):
    _, manifest = uneven
    _, a = _epoch_rows(manifest, 2, 32, epoch=0)
    _, b = _epoch_rows(manifest, 2, 32, epoch=0)
    _, c = _epoch_rows(manifest, 2, 32, epoch=1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0], c[0])
    assert not np.array_equal(a[0], np.sort(a[0]))  # actually shuffled


def test_skip_batches_resumes_the_same_order(uneven):
    _, manifest = uneven
    layout = SplitLayout.from_manifest(manifest, "train")
    make = lambda: RankLoader(layout, columns_for(manifest), 1, 2, 16, seed=5, shuffle_buffer_rows=64)  # noqa: E731
    full = [b["_row"].numpy() for b in make().epoch(2)]
    resumed = [b["_row"].numpy() for b in make().epoch(2, skip_batches=7)]
    assert len(resumed) == len(full) - 7
    assert all(np.array_equal(x, y) for x, y in zip(full[7:], resumed))


def test_batches_equal_the_transform_of_the_raw_rows(uneven):
    ds, manifest = uneven
    layout = SplitLayout.from_manifest(manifest, "train")
    loader = RankLoader(layout, columns_for(manifest), 0, 1, 64, seed=0, shuffle_buffer_rows=128)
    batch = next(iter(loader.epoch(0)))
    rows = batch["_row"].numpy()
    expected = manifest.features.transform(ds.raw["train"].iloc[rows])
    assert batch["numeric"].dtype.is_floating_point and batch["categorical"].dtype == __import__("torch").int64
    np.testing.assert_allclose(batch["numeric"].numpy(), expected["numeric"], rtol=1e-6)
    np.testing.assert_array_equal(batch["categorical"].numpy(), expected["categorical"])
    np.testing.assert_allclose(batch["image"].numpy(), expected["image"], rtol=1e-6)
    assert batch["image"].shape == (64, 2, 3)
    np.testing.assert_array_equal(batch["label"].numpy(), ds.raw["train"]["label"].to_numpy()[rows])


def _loader_threads():
    return {t for t in threading.enumerate() if t is not threading.main_thread()}


@pytest.mark.parametrize("how", ["break", "raise", "close", "full"])
def test_no_thread_outlives_its_epoch(uneven, how):
    # petastorm's reader threads are gone when the epoch ends, however the caller leaves it:
    # a leaked reader per epoch would pile up over a long run.
    _, manifest = uneven
    loader = RankLoader(SplitLayout.from_manifest(manifest, "train"), columns_for(manifest), 0, 1, 16, seed=1,
                        shuffle_buffer_rows=64)
    before = _loader_threads()
    if how == "break":
        for i, _ in enumerate(loader.epoch(0)):
            if i == 1:
                break
    elif how == "raise":
        with pytest.raises(KeyError):
            for _ in loader.epoch(0):
                raise KeyError("the training step failed")
    elif how == "close":
        batches = loader.epoch(0)
        next(batches)
        assert _loader_threads() > before  # the reader is running
        batches.close()
    else:
        assert len(list(loader.epoch(0))) == loader.batches_per_epoch
    assert _loader_threads() == before


def test_reader_errors_reach_the_caller_with_their_traceback(uneven):
    _, manifest = uneven

    class Broken(RankLoader):
        def _mask(self, table):
            raise ValueError("bad row group")

    loader = Broken(SplitLayout.from_manifest(manifest, "train"), columns_for(manifest), 0, 1, 16, seed=1,
                    shuffle_buffer_rows=64)
    before = _loader_threads()
    with pytest.raises(ValueError, match="bad row group") as info:
        list(loader.epoch(0))
    frames = [entry.name for entry in info.traceback]
    assert "_mask" in frames and "_shuffled_batches" in frames  # where it happened
    assert _loader_threads() == before


def test_read_first_rows_spans_row_groups_and_files(uneven):
    _, manifest = uneven
    layout = SplitLayout.from_manifest(manifest, "train")
    rows = read_first_rows(layout, columns_for(manifest), 400)["_row"]  # 300 + 77 in file 0, 13 in 1, 10 in 2
    np.testing.assert_array_equal(rows, np.arange(400))


@pytest.mark.s3
def test_ranks_read_the_same_batches_from_s3_as_from_local_disk(uneven, s3_bucket):
    """Shards on an S3 endpoint over real HTTP (moto on 127.0.0.1): every rank gets exactly the
    batches it gets from the local copy, through the same storage settings as the rest of shardtrain."""
    from common.storage import resolve

    ds, local = uneven
    resolve(s3_bucket).fs.put(ds.uri, f"{s3_bucket.removeprefix('s3://')}/ds", recursive=True)
    remote = read_manifest(f"{s3_bucket}/ds")
    assert remote.file_uris("train")[0].startswith("s3://")
    for rank in range(2):
        batches = {}
        for name, manifest in (("local", local), ("s3", remote)):
            loader = RankLoader(SplitLayout.from_manifest(manifest, "train"), columns_for(manifest), rank, 2, 64, seed=3)
            batches[name] = [{k: v.numpy().copy() for k, v in b.items()} for b in loader.epoch(1)]
        assert len(batches["s3"]) == len(batches["local"]) == loader.batches_per_epoch > 0
        for got, want in zip(batches["s3"], batches["local"]):
            for key in want:
                np.testing.assert_array_equal(got[key], want[key])
