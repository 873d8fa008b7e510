"""The arrow reader (data.reader=arrow): plain pyarrow, no petastorm, yet for the same seed, epoch
and rank it yields the batches petastorm's path yields, so runs and checkpoints do not depend on
which reader a profile has. Where petastorm is not installed (the current-stack profile) the
comparisons skip and the reader's own promises are still checked. The shuffle buffers both readers
share (their size, their reused memory) are checked here too, so that both profiles run it."""

import subprocess
import sys

import numpy as np
import pytest

from common.dataset import read_manifest
from common.errors import DatasetError
from tabular_data import write_dataset
from training.arrow_reader import row_group_order
from training.columns import columns_for
from training.data import RankLoader
from training.shuffle_buffers import BufferMemory
from training.split_layout import SplitLayout

pytestmark = pytest.mark.stack

# Files of unequal row groups (one empty file) that divide evenly by neither 2 nor 3 ranks.
UNEVEN = {"train": [[300, 77], [13], [500, 111, 2], [0], [250]], "val": [[90], [33]]}

@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    ds = write_dataset(str(tmp_path_factory.mktemp("arrow") / "ds"), UNEVEN, array_shape=(2, 3))
    return ds, read_manifest(ds.uri)


def _batches(manifest, reader, rank, world, epoch, shuffle=True, split="train", batch=32, skip=0, verify=True):
    loader = RankLoader(SplitLayout.from_manifest(manifest, split, verify), columns_for(manifest), rank, world, batch,
                        seed=11, shuffle=shuffle, shuffle_buffer_rows=150, reader=reader)
    return [{k: v.numpy().copy() for k, v in b.items()} for b in loader.epoch(epoch, skip_batches=skip)]


def _assert_same(a, b):
    assert len(a) == len(b) and a
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_arrow_and_petastorm_yield_identical_batches(uneven, world):
    pytest.importorskip("petastorm")
    _, manifest = uneven
    for rank in range(world):
        for epoch in (0, 1):
            _assert_same(_batches(manifest, "arrow", rank, world, epoch), _batches(manifest, "petastorm", rank, world, epoch))
    # Unshuffled (validation) order too.
    _assert_same(_batches(manifest, "arrow", 0, 2, 0, shuffle=False, split="val", batch=8),
                 _batches(manifest, "petastorm", 0, 2, 0, shuffle=False, split="val", batch=8))


def test_order_depends_on_epoch_and_rank_and_resumes(uneven):
    _, manifest = uneven
    first = _batches(manifest, "arrow", 1, 2, 0)
    _assert_same(first, _batches(manifest, "arrow", 1, 2, 0))  # a pure function of (seed, epoch, rank)
    assert not np.array_equal(first[0]["_row"], _batches(manifest, "arrow", 1, 2, 1)[0]["_row"])
    _assert_same(first[3:], _batches(manifest, "arrow", 1, 2, 0, skip=3))  # resume position = batch count
    rows = np.concatenate([b["_row"] for b in first])
    assert len(np.unique(rows)) == len(rows)  # no row twice in an epoch


def _readers():
    import importlib.util

    return ["arrow"] + (["petastorm"] if importlib.util.find_spec("petastorm") else [])


@pytest.mark.parametrize("reader", _readers())
def test_a_shuffle_buffer_holds_shuffle_buffer_rows_whatever_the_row_groups(uneven, reader):
    """Row groups larger than the buffer (the 300- and 500-row ones here) are cut, so a buffer's
    memory follows data.shuffle_buffer_rows; every row still lands in exactly one buffer."""
    import pyarrow.parquet as pq

    _, manifest = uneven
    layout = SplitLayout.from_manifest(manifest, "train")
    loader = RankLoader(layout, columns_for(manifest), 0, 1, 16, seed=2, shuffle_buffer_rows=64, reader=reader)
    files = [pq.ParquetFile(uri) for uri in manifest.file_uris("train")]
    tables = [f.read_row_group(g, columns=loader.columns.stored) for f in files for g in range(f.num_row_groups)]
    assert max(t.num_rows for t in tables) > 64
    buffers = list(loader.buffers.from_tables(iter(tables), np.random.default_rng(0)))
    sizes = [len(b.arrays["_row"]) for b in buffers]
    assert all(size == 64 for size in sizes[:-1]) and 0 < sizes[-1] <= 64
    rows = np.concatenate([b.arrays["_row"][:b.full] for b in buffers] + [buffers[-1].rest["_row"]])
    np.testing.assert_array_equal(np.sort(rows), np.arange(layout.rows))


def test_buffer_memory_hands_out_only_what_no_one_holds():
    import torch

    memory = BufferMemory()
    first = memory.empty((100, 4), np.float32)
    address = first.__array_interface__["data"][0]
    batch = torch.from_numpy(first[:10])  # a batch tensor the caller kept
    del first
    second = memory.empty((100, 4), np.float32)
    assert second.__array_interface__["data"][0] != address and memory.reused == 0
    assert memory.empty((100, 4), np.int64).__array_interface__["data"][0] != address  # another dtype
    del batch, second
    third = memory.empty((80, 4), np.float32)  # no one holds the first array now: its memory again
    assert third.__array_interface__["data"][0] == address and third.shape == (80, 4) and memory.reused == 1
    assert memory.empty((200, 4), np.float32).shape == (200, 4)  # too small to reuse: a new array


@pytest.mark.parametrize("reader", _readers())
def test_batches_a_caller_keeps_never_change_when_memory_is_reused(uneven, reader):
    """An epoch whose batches are all kept next to the same epoch read one batch at a time (each
    copied, then let go, so its memory is reused): equal, and the kept ones unchanged after."""
    _, manifest = uneven
    loader = RankLoader(SplitLayout.from_manifest(manifest, "train"), columns_for(manifest), 0, 1, 16, seed=4,
                        shuffle_buffer_rows=64, reader=reader)
    kept = list(loader.epoch(0))
    snapshot = [{k: v.clone() for k, v in b.items()} for b in kept]
    before = loader.memory.reused
    copies = [{k: v.clone() for k, v in b.items()} for b in loader.epoch(0)]
    assert loader.memory.reused > before  # the second pass did run on reused memory
    assert len(kept) == len(copies) == loader.batches_per_epoch
    for held, frozen, copy in zip(kept, snapshot, copies):
        for key in held:
            assert held[key].equal(frozen[key]) and held[key].equal(copy[key]), key


def test_row_group_order_is_petastorms_ventilator_order():
    # petastorm's ventilator shuffles its list of row-group items in place with RandomState(seed).
    items = [{"piece": (f, g)} for f, n in enumerate([2, 1, 3]) for g in range(n)]
    np.random.RandomState(7).shuffle(items)
    assert row_group_order([2, 1, 3], True, 7) == [item["piece"] for item in items]
    assert row_group_order([2, 0, 1], False, 7) == [(0, 0), (0, 1), (2, 0)]


def test_a_broken_shard_names_itself_and_stops_the_thread(uneven, tmp_path):
    import shutil
    import threading

    ds, manifest = uneven
    copy = tmp_path / "ds"
    shutil.copytree(ds.uri, copy)
    victim = copy / "train" / "part-00002.parquet"
    data = victim.read_bytes()
    victim.write_bytes(data[:4] + b"\0" * 64 + data[68:])  # corrupt the first page, keep the footer
    assert victim.read_bytes() != data
    broken = read_manifest(str(copy))
    before = threading.active_count()
    # The sha256 check (data.verify) would refuse the file first; this is the reader's own path.
    with pytest.raises(DatasetError, match="part-00002.parquet: row group"):
        _batches(broken, "arrow", 0, 1, 0, verify=False)
    assert threading.active_count() == before
    with pytest.raises(DatasetError, match="part-00002.parquet: sha256"):
        _batches(broken, "arrow", 0, 1, 0)


def test_a_file_that_is_not_parquet_names_itself(uneven, tmp_path):
    """No footer at all (what test_integrity's garbage shard is, with data.verify=never), as each
    stack's pyarrow reports it: one error naming the file and what to do."""
    import shutil

    ds, _ = uneven
    copy = tmp_path / "ds"
    shutil.copytree(ds.uri, copy)
    victim = copy / "train" / "part-00002.parquet"
    victim.write_bytes(b"not parquet" * 100)
    assert victim.read_bytes()[:11] == b"not parquet"
    with pytest.raises(DatasetError, match=r"part-00002.parquet: not a readable Parquet file.*re-run the shard job"):
        _batches(read_manifest(str(copy)), "arrow", 0, 1, 0, verify=False)


def test_leaving_an_epoch_early_ends_both_reader_threads(uneven):
    import threading

    _, manifest = uneven
    loader = RankLoader(SplitLayout.from_manifest(manifest, "train"), columns_for(manifest), 0, 1, 32, seed=11,
                        shuffle_buffer_rows=150, prefetch_row_groups=1, reader="arrow")
    epoch = loader.epoch(0)
    next(epoch)
    names = {t.name for t in threading.enumerate()}
    assert {"arrow-row-groups", "arrow-pipeline"} <= names  # the decoder and the buffer builder ran
    epoch.close()  # what a training loop's break or error does to the generator
    assert not {t.name for t in threading.enumerate()} & {"arrow-row-groups", "arrow-pipeline"}


@pytest.mark.s3
def test_shards_on_s3_give_the_batches_of_the_local_copy(uneven, s3_bucket):
    """Through common.storage's S3 file system (moto over real HTTP on 127.0.0.1): every rank gets
    exactly the batches the local files give, shuffled and not."""
    from common.storage import resolve

    ds, local = uneven
    resolve(s3_bucket).fs.put(ds.uri, f"{s3_bucket.removeprefix('s3://')}/ds", recursive=True)
    remote = read_manifest(f"{s3_bucket}/ds")
    assert remote.file_uris("train")[0].startswith("s3://")
    for rank in range(2):
        _assert_same(_batches(remote, "arrow", rank, 2, 1), _batches(local, "arrow", rank, 2, 1))
    _assert_same(_batches(remote, "arrow", 0, 1, 0, shuffle=False, split="val", batch=8),
                 _batches(local, "arrow", 0, 1, 0, shuffle=False, split="val", batch=8))


def test_arrow_path_never_imports_petastorm(uneven):
    ds, _ = uneven
    code = ("import sys; sys.path.insert(0, 'tests/training')\n"
            "from common.dataset import read_manifest\n"
            "from training.columns import columns_for\n"
            "from training.data import RankLoader\n"
            "from training.split_layout import SplitLayout\n"
            f"m = read_manifest({ds.uri!r})\n"
            "loader = RankLoader(SplitLayout.from_manifest(m, 'train'), columns_for(m), 0, 2, 32, reader='arrow')\n"
            "assert sum(1 for _ in loader.epoch(0)) == loader.batches_per_epoch\n"
            "assert 'petastorm' not in sys.modules, 'petastorm was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
