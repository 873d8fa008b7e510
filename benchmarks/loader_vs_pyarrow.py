"""Loader vs its limit: samples/s of one rank's training input path (shard files -> petastorm ->
shuffled torch batches, exactly as training uses it) against the limit measured in the same
process on the same files: pyarrow reads the row groups and torch.from_numpy builds the same
tensors, in file order, with no shuffle.

    .venv/bin/python benchmarks/loader_vs_pyarrow.py                  # tabular 1M rows + 28x28 arrays 200k rows
    .venv/bin/python benchmarks/loader_vs_pyarrow.py --rows 200000 --array-rows 50000 --repeats 1

Prints one JSON line per dataset: samples/s of both, MB/s decoded, and ratio = ours / limit.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import Timer, emit, machine, sharded_dataset  # noqa: E402


def limit_pass(layout, columns, batch_size: int) -> tuple[int, int]:
    """pyarrow row groups -> the same batch tensors, no shuffle, no petastorm: the ceiling."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    from pipelines.storage import resolve

    samples = nbytes = 0
    wanted = columns.stored
    for shard in layout.files:
        loc = resolve(shard.uri)
        with loc.fs.open(loc.path, "rb") as fh:
            pf = pq.ParquetFile(fh)
            for g in range(pf.num_row_groups):
                table = pf.read_row_group(g, columns=wanted)
                nbytes += table.nbytes
                tensors = {
                    "numeric": torch.from_numpy(np.column_stack([table.column(c).to_numpy() for c in columns.numeric])),
                    "categorical": torch.from_numpy(np.column_stack(
                        [table.column(c).to_numpy().astype(np.int64) for c in columns.categorical])),
                    "label": torch.from_numpy(table.column(columns.label).to_numpy()),
                }
                for name, shape in columns.arrays:
                    flat = table.column(name).combine_chunks().flatten().to_numpy()
                    tensors[name] = torch.from_numpy(flat.reshape((table.num_rows, *shape)))
                for start in range(0, table.num_rows - batch_size + 1, batch_size):
                    batch = {k: v[start:start + batch_size] for k, v in tensors.items()}
                    samples += len(batch["label"])
    return samples, nbytes


def ours_pass(layout, columns, batch_size: int, workers: int) -> int:
    from training.data import RankLoader

    loader = RankLoader(layout, columns, rank=0, world_size=1, batch_size=batch_size, seed=0,
                        reader_workers=workers)
    samples = 0
    for batch in loader.epoch(0):
        samples += len(batch["label"])
    return samples


def measure(uri: str, batch_size: int, repeats: int, workers: int) -> dict:
    from pipelines.manifest import read_manifest
    from training.data import SplitLayout, columns_for

    manifest = read_manifest(uri)
    layout, columns = SplitLayout.from_manifest(manifest, "train"), columns_for(manifest)
    best_ours = best_limit = float("inf")
    samples_ours = samples_limit = nbytes = 0
    ours_pass(layout, columns, batch_size, workers)  # warm the page cache and imports once
    for _ in range(repeats):  # alternate, so drift on a shared machine hits both sides alike
        with Timer() as t:
            samples_limit, nbytes = limit_pass(layout, columns, batch_size)
        best_limit = min(best_limit, t.seconds)
        with Timer() as t:
            samples_ours = ours_pass(layout, columns, batch_size, workers)
        best_ours = min(best_ours, t.seconds)
    ours, limit = samples_ours / best_ours, samples_limit / best_limit
    return {"dataset": os.path.basename(uri), "rows": layout.rows, "batch_size": batch_size,
            "reader_workers": workers, "ours_samples_per_s": round(ours), "limit_samples_per_s": round(limit),
            "limit_MB_per_s": round(nbytes / best_limit / 1e6, 1), "ratio": round(ours / limit, 3)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default="/tmp/shardtrain-bench")
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of the tabular dataset")
    parser.add_argument("--array-rows", type=int, default=200_000, help="rows of the 28x28 array dataset (0: skip)")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1, help="petastorm reader threads")
    args = parser.parse_args(argv)
    os.makedirs(args.workdir, exist_ok=True)
    datasets = [sharded_dataset(args.workdir, args.rows)]
    if args.array_rows:
        datasets.append(sharded_dataset(args.workdir, args.array_rows, array_shape=[28, 28], numeric=4,
                                        categorical=2, rows_per_row_group=10_000))
    for uri in datasets:
        emit({"benchmark": "loader_vs_pyarrow", **measure(uri, args.batch_size, args.repeats, args.workers),
              "machine": machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
