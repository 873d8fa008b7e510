"""Where a training step's time goes (issue 5, item 2): for the default MLP and a larger one,
1 rank (in-process, no Horovod) vs 2 ranks (Horovod on local Spark, local[2]), fp32 vs bf16.
With ``--compare-backends`` (issue 10): 2 ranks on each backend instead, same model, data and seed,
Horovod then torch (TorchDistributor, DDP), both with the same reader (``--reader``; default:
data.reader's own), and their samples/s ratio.

    .venv/bin/python benchmarks/train_step_breakdown.py [--rows 50000] [--epochs 2] [--batch-size 512]
    .venv/bin/python benchmarks/train_step_breakdown.py --compare-backends [--models default,large]

Prints one JSON line per configuration, from rank 0's per-epoch metrics (training/loop.py), the
first epoch left out (reader start-up, allocator warm-up) when there are more:

* ``data_wait`` : share of the epoch's wall time the loop was blocked in the loader's next();
* ``allreduce_wait`` : share spent waiting for the part of the gradient allreduce that backward
  did not hide (measured, not estimated; 0 for 1 rank). Horovod: time blocked in
  ``optimizer.synchronize()``. DDP waits inside backward, so there it is the time from the start
  of the step's last bucket allreduce (every gradient computed by then) to the end of backward
  (``TorchGroup.allreduce_wait``, from a DDP communication hook doing DDP's own allreduce);
* ``compute`` : the rest: forward, backward, optimizer step (and the non-hidden part of
  Horovod's background allreduce that shows up as slower backward);
* ``allreduce_estimate`` (2-rank lines): 1 - (1-rank compute seconds per sample per rank) /
  (2-rank compute+allreduce seconds per sample per rank); a difference estimate that also
  contains the two ranks competing for the same 2 cores, so an upper bound here.

The dataset (16 numeric + 2 categorical columns) is written with pyarrow under a temp directory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
warnings.filterwarnings("ignore")

MODELS = {"default": [256, 256], "large": [1024, 1024, 1024]}


def run(args, data: str, workdir: str, model: str, ranks: int, precision: str, spark,
        backend: str = "horovod") -> dict:
    from training import load_train_config, train

    hidden = MODELS[model]
    reader = args.reader or ("petastorm" if _installed("petastorm") else "arrow")  # data.reader's own default
    cfg = load_train_config(None, [f"launch.backend={backend}", f"data.reader={reader}",
        f"data.path={data}", "data.val_split=null", f"model.hidden=[{', '.join(map(str, hidden))}]",
        f"train.epochs={args.epochs}", f"train.batch_size={args.batch_size}", f"train.precision={precision}",
        "train.log_every_steps=1000000", "checkpoint.every_epochs=null", "checkpoint.resume=never",
        f"launch.num_proc={ranks}", f"launch.mode={'in_process' if ranks == 1 else 'spark'}",
        "launch.start_timeout=120", f"output.model_path={workdir}/{model}-{ranks}-{precision}-{backend}",
        "output.mode=overwrite"])
    result = train(cfg, spark=spark) if ranks > 1 else train(cfg)
    epochs = result.metrics[1:] if len(result.metrics) > 1 else result.metrics
    seconds = sum(m["seconds"] for m in epochs)
    wait = sum(m["data_wait_seconds"] for m in epochs)
    allreduce = sum(m["allreduce_wait_seconds"] for m in epochs)
    samples = sum(m["samples"] for m in epochs)
    return {"benchmark": "train_step_breakdown", "backend": backend if ranks > 1 else "in_process",
            "reader": reader, "model": model, "hidden": hidden, "ranks": ranks,
            "precision": precision, "batch_size_per_rank": args.batch_size, "epochs_measured": len(epochs),
            "samples_per_s": round(samples / seconds), "step_ms": round(1000 * seconds * ranks * args.batch_size / samples, 2),
            "data_wait": round(wait / seconds, 4), "allreduce_wait": round(allreduce / seconds, 4),
            "compute": round((seconds - wait - allreduce) / seconds, 4),
            "_compute_s_per_sample_per_rank": (seconds - wait) * ranks / samples}


def compare_backends(args, data: str, workdir: str, model: str, precision: str, spark) -> None:
    """The same 2-rank training on both backends, one after the other; then the torch/horovod ratio."""
    records = {}
    for backend in ("horovod", "torch"):
        record = run(args, data, workdir, model, 2, precision, spark, backend=backend)
        record.pop("_compute_s_per_sample_per_rank")
        records[backend] = record
        print(json.dumps(record), flush=True)
    print(json.dumps({"benchmark": "train_step_backends", "model": model, "precision": precision, "ranks": 2,
                      "torch_vs_horovod_samples_per_s": round(records["torch"]["samples_per_s"]
                                                              / records["horovod"]["samples_per_s"], 3),
                      "load_average_1m": round(os.getloadavg()[0], 1)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--models", default="default,large")
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--compare-backends", action="store_true",
                        help="2 ranks on Horovod, then on torch (no 1-rank runs)")
    parser.add_argument("--reader", default=None, choices=["arrow", "petastorm"], help="data.reader for every run")
    args = parser.parse_args()
    import logging

    from loader_throughput import write
    from common.config import SparkConfig
    from common.spark import get_or_create_session

    logging.getLogger("shardtrain").setLevel(logging.WARNING)
    # Spark's Python workers (and so the Horovod ranks) must run this interpreter, with torch and horovod.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    tmp = tempfile.mkdtemp(prefix="step-breakdown-")
    data = write(f"{tmp}/data", args.rows, numeric=16, categorical=2, array_shape=None, files=4,
                 row_group=max(1000, args.rows // 16))
    spark = get_or_create_session(SparkConfig(master="local[2]", app_name="train_step_breakdown",
                                              conf={"spark.ui.enabled": False}), log_level="ERROR")
    try:
        for model in args.models.split(","):
            for precision in args.precisions.split(","):
                if args.compare_backends:
                    compare_backends(args, data, tmp, model, precision, spark)
                    continue
                one = None
                for ranks in (1, 2):
                    record = run(args, data, tmp, model, ranks, precision, spark)
                    per_sample = record.pop("_compute_s_per_sample_per_rank")
                    if ranks == 1:
                        one = per_sample
                    else:
                        record["allreduce_estimate"] = round(max(0.0, 1 - one / per_sample), 4)
                    print(json.dumps(record), flush=True)
    finally:
        spark.stop()


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


if __name__ == "__main__":
    main()
