"""GPU check for a device machine (no Java, no Spark, no network): the in-process training mode
(world size 1, no Horovod launcher) on CUDA, for fp32, bf16 and fp16, on shards made here.

For each precision it prints one JSON line: samples/s, the fraction of wall time the training
loop waited on the loader, and model FLOP utilisation (6 x parameters x samples/s against the
chip's dense peak for that precision). It runs well inside 5 minutes on an H200.

Prepare here (makes .device/shards and the wheels in .whl/; see benchmarks/gpu_prepare.sh), then
run there with the device tool, carrying .whl and .device:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site:$PWD || exit; python3 benchmarks/gpu_check.py --data .device/shards --out $OUT

Here, on CPU, as a smoke test of the same code path:

    .venv/bin/python benchmarks/gpu_check.py --data .device/shards --device cpu --epochs 2 --hidden 256 --layers 2 \
      --batch-size 1024 --replicate 3 --precisions fp32,bf16
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=DeprecationWarning)

# Dense peak FLOP/s of an H100/H200 SXM (NVIDIA's datasheet, without sparsity). fp32 is run
# with TF32 matmuls enabled, which is how anyone trains in "fp32" on Hopper.
PEAK = {"bf16": 989e12, "fp16": 989e12, "fp32": 494e12}


def count_params(model_uri: str) -> int:
    from safetensors import safe_open

    from common.storage import resolve
    from common.model_artifact import WEIGHTS

    loc = resolve(model_uri)
    total = 0
    with safe_open(os.path.join(loc.path, WEIGHTS), framework="pt") as fh:
        for key in fh.keys():
            total += _prod(fh.get_slice(key).get_shape())
    return total


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


def replicate(uri: str, copies: int, workdir: str) -> str:
    """A larger dataset from the carried one: its train files ``copies`` times over, with ``_row``
    renumbered so the manifest contract holds (the device tool carries at most 64 MiB, and an
    epoch of the carried rows alone is shorter than a reader's start-up on an H200)."""
    import copy

    import pyarrow as pa
    import pyarrow.parquet as pq

    from common.commit_marker import is_committed
    from common.dataset import read_manifest, ROW_INDEX
    from common.dataset_files import file_entry
    from common.manifest_builder import build_manifest, write_manifest
    from common.publish import publish

    target = os.path.join(workdir, f"data-x{copies}")
    if is_committed(target):
        return target
    manifest = read_manifest(uri)
    data = copy.deepcopy(manifest.data)
    files, first = [], 0
    with publish(target, mode="overwrite") as staging:
        os.makedirs(os.path.join(staging.path, "train"), exist_ok=True)
        for c in range(copies):
            for entry in manifest.files("train"):
                table = pq.read_table(os.path.join(manifest.root.path, entry.path))
                rows = pa.array(range(first, first + table.num_rows), pa.int64())
                table = table.set_column(table.schema.get_field_index(ROW_INDEX), ROW_INDEX, rows)
                rel = f"train/part-{len(files):05d}.parquet"
                path = os.path.join(staging.path, rel)
                pq.write_table(table, path, row_group_size=max(entry.row_groups))
                files.append(file_entry(staging, rel))
                first += table.num_rows
        splits = {"train": {"rows": first, "files": files}}
        write_manifest(staging, build_manifest(splits, data["features"], data["label"]))
    return target


def run_one(args, precision: str, data_uri: str) -> dict:
    import torch

    from training.api import train
    from training.config import load_train_config

    out = os.path.join(args.workdir, f"model-{precision}")
    overrides = [
        f"data.path={data_uri}", "data.val_split=null",
        "model.name=mlp", f"model.hidden=[{', '.join([str(args.hidden)] * args.layers)}]",
        f"train.epochs={args.epochs}", f"train.batch_size={args.batch_size}", f"train.precision={precision}",
        "train.lr=0.0005", "train.warmup_steps=0", "train.log_every_steps=1000000",
        "launch.mode=in_process", "launch.num_proc=1", f"launch.device={args.device}",
        "checkpoint.every_epochs=null", "checkpoint.resume=never",
        f"output.model_path={out}", "output.mode=overwrite",
    ]
    cfg = load_train_config(None, overrides)
    started = time.perf_counter()
    result = train(cfg)
    wall = time.perf_counter() - started
    # The first epoch carries CUDA/cuBLAS warm-up; measure the rest when there is a rest.
    epochs = result.metrics[1:] if len(result.metrics) > 1 else result.metrics
    seconds = sum(m["seconds"] for m in epochs)
    samples = sum(m["samples"] for m in epochs)
    wait = sum(m["data_wait_seconds"] for m in epochs)
    params = count_params(result.model_uri)
    rate = samples / seconds
    flops = 6 * params * rate
    record = {"benchmark": "gpu_check", "precision": precision, "device": args.device,
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
              "params": params, "batch_size": args.batch_size, "epochs_measured": len(epochs),
              "samples_per_s": round(rate), "data_wait_fraction": round(wait / seconds, 4),
              "model_tflops": round(flops / 1e12, 2), "wall_s": round(wall, 1)}
    if args.device == "cuda":
        record["mfu"] = round(flops / PEAK[precision], 4)
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="a published dataset (shards + manifest)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--precisions", default="fp32,bf16,fp16")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=8192)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--replicate", type=int, default=40, help="train on the carried train split this many times over")
    parser.add_argument("--workdir", default="/tmp/shardtrain-gpu")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="folder for results.jsonl")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device here; use --device cpu for a smoke test", file=sys.stderr)
            return 2
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    records = []
    data_uri = os.path.abspath(args.data)
    if args.replicate > 1:
        data_uri = replicate(data_uri, args.replicate, args.workdir)
    for precision in args.precisions.split(","):
        record = run_one(args, precision, data_uri)
        records.append(record)
        print(json.dumps(record, sort_keys=True), flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.jsonl"), "w") as fh:
            fh.writelines(json.dumps(r, sort_keys=True) + "\n" for r in records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
