"""Loader vs its limit (issue 5, item 1): samples/s of the training input path (shard files ->
petastorm -> shuffled torch batches, training.data.RankLoader) against the limit measured in the
same process on the same files (pyarrow reads each row group, torch.from_numpy builds the same
tensors, no shuffle), and against petastorm's own batch conversion (pandas + np.vstack per row);
the arrow reader (data.reader=arrow) against the petastorm path and against petastorm's stock
``BatchedDataLoader`` with the same shuffling capacity, all in one run.

    .venv/bin/python benchmarks/loader_throughput.py [--rows 1000000] [--array-rows 100000] [--batch 1024] [--repeats 3]

Prints one JSON line per dataset (tabular; with a 28x28 array column). Datasets are written with
pyarrow and the shard job's writer options under a temp directory, with a manifest that follows pipelines/manifest.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

from common.commit_marker import MARKER  # noqa: E402
from common.dataset import read_manifest
from common.dataset_files import file_entry
from common.manifest_builder import build_manifest, write_manifest
from common.storage import resolve  # noqa: E402
from pipelines.shard_writer import COMPRESSION_SAMPLE_ROWS, writer_options  # noqa: E402


def write(root: str, rows: int, numeric: int, categorical: int, array_shape, files: int, row_group: int) -> str:
    rng = np.random.default_rng(0)
    os.makedirs(f"{root}/train", exist_ok=True)
    per_file = rows // files
    entries, start = [], 0
    for i in range(files):
        n = per_file if i < files - 1 else rows - start
        cols = {f"x{j}": rng.standard_normal(n, dtype=np.float32) for j in range(numeric)}
        cols.update({f"c{j}": rng.integers(0, 50, n, dtype=np.int32) for j in range(categorical)})
        if array_shape:
            width = int(np.prod(array_shape))
            flat = rng.standard_normal(n * width, dtype=np.float32)
            cols["image"] = pa.ListArray.from_arrays(pa.array(np.arange(0, n * width + 1, width, dtype=np.int32)),
                                                     pa.array(flat))
        cols["label"] = rng.integers(0, 2, n)
        cols["_row"] = np.arange(start, start + n, dtype=np.int64)
        rel = f"train/part-{i:05d}.parquet"
        table = pa.table(cols)
        # What the shard job writes (pipelines/shard_writer.py): required columns (no definition
        # levels to decode) and its encodings and compression, so every path reads what it would.
        table = table.cast(pa.schema([pa.field(f.name, f.type, nullable=False) for f in table.schema]))
        options = writer_options(table.schema, table.slice(0, COMPRESSION_SAMPLE_ROWS))
        pq.write_table(table, f"{root}/{rel}", row_group_size=row_group, **options)
        entries.append(file_entry(resolve(root), rel))
        start += n
    features = {"numeric": [{"name": f"x{j}", "mean": 0, "std": 1, "fill": 0} for j in range(numeric)],
                "categorical": [{"name": f"c{j}", "vocab": [str(v) for v in range(48)]} for j in range(categorical)],
                "arrays": [{"name": "image", "shape": list(array_shape)}] if array_shape else []}
    label = {"name": "label", "task": "classification", "num_classes": 2, "train_class_counts": [1, 1]}
    splits = {"train": {"rows": rows, "files": entries}}
    write_manifest(resolve(root), build_manifest(splits, features, label))
    open(f"{root}/{MARKER}", "w").write("{}")
    return root


def limit(manifest, columns, batch: int) -> tuple[float, int]:
    """pyarrow row groups -> the same tensors with torch.from_numpy; no shuffle, no petastorm."""
    import torch

    from training.columns import table_to_arrays

    rows = 0
    start = time.perf_counter()
    for uri in manifest.file_uris("train"):
        pf = pq.ParquetFile(uri)
        for i in range(pf.num_row_groups):
            # pyarrow's fastest read of this layout: threaded by column unless a list column is read
            # (then single-threaded is 2-3x faster; training/arrow_reader.py makes the same choice).
            table = pf.read_row_group(i, columns=columns.stored, use_threads=not any(e.shape for e in columns.features))
            arrays = table_to_arrays(table, columns)
            n = len(arrays["label"])
            for s in range(0, n - batch + 1, batch):
                tensors = {k: torch.from_numpy(v[s:s + batch]) for k, v in arrays.items()}
                rows += len(tensors["label"])
    return rows / (time.perf_counter() - start), rows


def ours(manifest, columns, batch: int, workers: int = 1, buffer: int = 65_536, shuffle: bool = True,
         reader: str = "petastorm") -> tuple[float, int]:
    """One epoch of RankLoader. Without the sha256 check (data.verify): a run makes it once per
    file, not per epoch, and the stock loader makes none; ``verify_seconds`` reports it alone."""
    from training.data import RankLoader
    from training.split_layout import SplitLayout

    loader = RankLoader(SplitLayout.from_manifest(manifest, "train", verify=False), columns, 0, 1, batch,
                        reader_workers=workers, shuffle_buffer_rows=buffer, shuffle=shuffle, reader=reader)
    rows = 0
    start = time.perf_counter()
    for b in loader.epoch(0):
        rows += len(b["label"])
    return rows / (time.perf_counter() - start), rows


def petastorm_default(manifest, columns, batch: int) -> tuple[float, int]:
    """petastorm's own batch conversion (pandas, np.vstack of per-row lists), then torch tensors.
    Without ``_row``: petastorm's batch reader builds a namedtuple, which rejects that name."""
    import re

    import torch
    from petastorm import make_batch_reader

    urls = [f"file://{u}" for u in manifest.file_uris("train")]
    rows = 0
    start = time.perf_counter()
    with make_batch_reader(urls, schema_fields=[re.escape(c) + "$" for c in columns.stored if c != "_row"],
                           workers_count=1,
                           num_epochs=1, shuffle_row_groups=False) as reader:
        for chunk in reader:
            d = chunk._asdict()
            n = len(d["label"])
            num = np.stack([d[c] for e in columns.features if not e.shape and e.dtype == "float32" for c in e.columns],
                           axis=1)
            for s in range(0, n - batch + 1, batch):
                tensors = [torch.from_numpy(num[s:s + batch]), torch.from_numpy(d["label"][s:s + batch])]
                tensors += [torch.from_numpy(np.ascontiguousarray(d[name][s:s + batch])) for e in columns.features if e.shape
                            for name in e.columns]
                rows += batch
    return rows / (time.perf_counter() - start), rows


def petastorm_stock(manifest, columns, batch: int, buffer: int = 65_536) -> tuple[float, int]:
    """What users run today: petastorm.pytorch.BatchedDataLoader over make_batch_reader, shuffled
    with the same capacity as our buffer (``_row`` left out: petastorm's namedtuple rejects it)."""
    import re

    from petastorm import make_batch_reader
    from petastorm.pytorch import BatchedDataLoader

    urls = [f"file://{u}" for u in manifest.file_uris("train")]
    fields = [re.escape(c) + "$" for c in columns.stored if c != "_row"]
    rows = 0
    start = time.perf_counter()
    with make_batch_reader(urls, schema_fields=fields, workers_count=1, num_epochs=1) as reader:
        for b in BatchedDataLoader(reader, batch_size=batch, shuffling_queue_capacity=buffer):
            rows += len(b["label"])
    return rows / (time.perf_counter() - start), rows


def verify_seconds(manifest) -> float:
    """What data.verify costs once per run: the sha256 of every train file."""
    from training.split_layout import SplitLayout

    layout = SplitLayout.from_manifest(manifest, "train")
    start = time.perf_counter()
    layout.verify_files(layout.files)
    return time.perf_counter() - start


class CpuSeconds:
    """The least process CPU time (all threads) each path took for an epoch: the work it does,
    which the other processes on a shared machine do not change, unlike its samples/s."""

    def __init__(self):
        self.best: dict[str, float] = {}

    def __call__(self, key: str, fn, *args, **kwargs):
        start = time.process_time()
        result = fn(*args, **kwargs)
        spent = time.process_time() - start
        self.best[key] = min(self.best.get(key, spent), spent)
        return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--array-rows", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs of each path; the best counts")
    parser.add_argument("--row-group-rows", type=int, default=None,
                        help="rows per row group (default: what the shard job writes for this row width, "
                             "i.e. 16 MiB of stored data)")
    args = parser.parse_args()
    import torch

    from training.columns import columns_for

    torch.set_num_threads(1)
    # Removed at the end: each run writes ~370 MB of Parquet (the runs of earlier sessions had left 13 GB in /tmp).
    with tempfile.TemporaryDirectory(prefix="loader-bench-") as tmp:
        for name, rows, shape in (("tabular", args.rows, None), ("array28x28", args.array_rows, (28, 28))):
            from pipelines.balance import rows_per_row_group

            width = 16 * 4 + 2 * 4 + 8 + 8 + (4 * int(np.prod(shape)) if shape else 0)  # stored bytes per row
            row_group = args.row_group_rows or rows_per_row_group(None, None, width)
            root = write(f"{tmp}/{name}", rows, numeric=16, categorical=2, array_shape=shape, files=4,
                         row_group=row_group)
            manifest = read_manifest(root)
            columns = columns_for(manifest)
            limit(manifest, columns, args.batch)  # warm the page cache
            # Interleaved and best-of-N: the cores are shared, so single runs swing by 2x.
            lim = our = our4 = pet = arrow = stock = 0.0
            have_petastorm = _installed("petastorm")
            # What the shuffle costs: a random gather over the buffer is cache-miss bound, so it
            # grows with the buffer ("none": row-group order shuffled, rows in file order).
            sweep = {"16384": 0.0, "262144": 0.0, "none": 0.0}
            cpu = CpuSeconds()
            for _ in range(args.repeats):
                lim = max(lim, cpu("limit", limit, manifest, columns, args.batch)[0])
                rate, n = cpu("arrow", ours, manifest, columns, args.batch, reader="arrow")
                arrow = max(arrow, rate)
                if not have_petastorm:  # the current-stack profile: the arrow reader and the limit only
                    continue
                our = max(our, cpu("petastorm_path", ours, manifest, columns, args.batch)[0])
                our4 = max(our4, ours(manifest, columns, args.batch, workers=4)[0])
                pet = max(pet, petastorm_default(manifest, columns, args.batch)[0])
                stock = max(stock, cpu("petastorm_stock", petastorm_stock, manifest, columns, args.batch)[0])
                for key in sweep:
                    rate = (ours(manifest, columns, args.batch, shuffle=False) if key == "none"
                            else ours(manifest, columns, args.batch, buffer=int(key)))[0]
                    sweep[key] = max(sweep[key], rate)
            record = {"dataset": name, "rows": rows, "rows_per_row_group": row_group, "batch": args.batch,
                      "cpus": os.cpu_count(), "limit_samples_per_s": round(lim),
                      "arrow_reader_samples_per_s": round(arrow), "arrow_reader_ratio": round(arrow / lim, 3),
                      "rows_per_epoch": n, "verify_seconds": round(verify_seconds(manifest), 3),
                      "cpu_seconds_per_epoch": {k: round(v, 3) for k, v in cpu.best.items()},
                      "load_average_1m": round(os.getloadavg()[0], 1)}
            if not have_petastorm:
                print(json.dumps(record), flush=True)
                continue
            print(json.dumps({**record,
                              # The arrow reader against the petastorm path and petastorm's stock loader
                              # (both shuffled, 65,536-row buffer / shuffling capacity).
                              "arrow_vs_petastorm_path": round(arrow / our, 3),
                              "arrow_vs_petastorm_stock_loader": round(arrow / stock, 3),
                              "petastorm_stock_samples_per_s": round(stock),
                              "loader_samples_per_s": round(our),
                              "loader_ratio": round(our / lim, 3), "loader_4_workers_ratio": round(our4 / lim, 3),
                              "petastorm_default_ratio": round(pet / lim, 3),
                              "loader_ratio_by_shuffle_buffer": {"65536 (default)": round(our / lim, 3),
                                                                 **{k: round(v / lim, 3) for k, v in sweep.items()}}}),
                  flush=True)


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


if __name__ == "__main__":
    main()
