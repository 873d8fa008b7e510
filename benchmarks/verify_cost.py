"""What ``data.verify: first_read`` costs (issue 9): one training epoch through RankLoader with
the sha256 check of every file (the first read of each file in a run) and without it
(``data.verify: never``), interleaved in the same process on the same files.

    .venv/bin/python benchmarks/verify_cost.py [--rows 1000000] [--batch 1024] [--repeats 3]

Prints one JSON line: loader-only epoch seconds with and without verification (best of N each),
their ratio (the worst case: nothing but reading), the bytes hashed and the sha256 rate; then a
whole training epoch in process (small MLP, world size 1) with and without. A fresh SplitLayout per run makes every run a first read.
The files sit in the page cache after the warm-up, so this is the CPU cost of hashing; on S3 or
HDFS the check also reads each file once more over the network.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

from loader_throughput import write  # noqa: E402


def epoch_seconds(manifest, columns, batch: int, verify: bool) -> float:
    from training.data import RankLoader
    from training.split_layout import SplitLayout

    layout = SplitLayout.from_manifest(manifest, "train", verify=verify)
    loader = RankLoader(layout, columns, 0, 1, batch)
    start = time.perf_counter()
    for _ in loader.epoch(0):
        pass
    seconds = time.perf_counter() - start
    assert len(layout.verified) == (len(layout.files) if verify else 0)
    return seconds


def train_seconds(root: str, out: str, verify: str, batch: int) -> float:
    """One training epoch in process (world size 1, small MLP, no validation split)."""
    from training import load_train_config, train

    cfg = load_train_config(None, [f"data.path={root}", "data.val_split=null", "launch.mode=in_process",
                                   "launch.num_proc=1", "train.epochs=1", f"train.batch_size={batch}",
                                   "model.hidden=[64]", f"output.model_path={out}", "output.mode=overwrite",
                                   "checkpoint.every_epochs=null", "checkpoint.resume=never", f"data.verify={verify}"])
    start = time.perf_counter()
    train(cfg)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--train-repeats", type=int, default=2,
                        help="also time whole training epochs (in process) with and without; 0 to skip")
    args = parser.parse_args()
    import torch

    from common.dataset import read_manifest
    from common.dataset_files import verify_dataset
    from pipelines.balance import rows_per_row_group
    from training.columns import columns_for

    torch.set_num_threads(1)
    width = 16 * 4 + 2 * 4 + 8 + 8
    root = write(f"{tempfile.mkdtemp(prefix='verify-bench-')}/tabular", args.rows, numeric=16, categorical=2,
                 array_shape=None, files=4, row_group=rows_per_row_group(None, None, width))
    manifest = read_manifest(root)
    columns = columns_for(manifest)
    epoch_seconds(manifest, columns, args.batch, verify=True)  # warm the page cache
    on = off = float("inf")
    for _ in range(args.repeats):
        on = min(on, epoch_seconds(manifest, columns, args.batch, verify=True))
        off = min(off, epoch_seconds(manifest, columns, args.batch, verify=False))
    train_on = train_off = float("inf")
    for i in range(args.train_repeats):
        train_on = min(train_on, train_seconds(root, f"{root}-model", "first_read", args.batch))
        train_off = min(train_off, train_seconds(root, f"{root}-model", "never", args.batch))
    size = sum(f.bytes for f in manifest.files("train"))
    start = time.perf_counter()
    assert verify_dataset(manifest) == []
    hash_s = time.perf_counter() - start
    print(json.dumps({"rows": args.rows, "files": manifest.num_shards("train"), "bytes": size, "cpus": os.cpu_count(),
                      "epoch_s_verify_first_read": round(on, 3), "epoch_s_verify_never": round(off, 3),
                      "ratio": round(on / off, 3), "sha256_MB_per_s": round(size / hash_s / 1e6, 1),
                      **({"train_epoch_s_verify_first_read": round(train_on, 2),
                          "train_epoch_s_verify_never": round(train_off, 2),
                          "train_ratio": round(train_on / train_off, 3)} if args.train_repeats else {})}),
          flush=True)


if __name__ == "__main__":
    main()
