"""Memory is flat in the dataset size (issue 5, item 4): peak RSS of the Spark driver during
generate + shard, and of a training rank during one epoch, at a small and a large row count.

    .venv/bin/python benchmarks/memory_flat.py [--sizes 1000000,4000000] [--workdir /tmp/memory-flat]
    .venv/bin/python benchmarks/memory_flat.py --images 500,2000,8000 [--side 96] [--buffer-mb 4]

Prints one JSON line per size; the lines after the first also carry ``*_ratio`` = this size's
peak / the first size's peak (flat ~= 1.0, proportional ~= the rows ratio).

Each phase of each size runs in a fresh Python subprocess, so peaks never carry over:

* **shard**: ``generate_dataset`` + ``shard_dataset`` on local[2] with spark.driver.memory 2g.
  The Spark driver is the Python driver process plus the driver JVM (the ``java`` descendant of
  the Python process that pyspark's gateway launched); a background thread samples both with
  psutil every 0.2 s. In local mode the executors live inside the driver JVM, so the JVM figure
  is an upper bound on what the driver alone holds. Spark's Python workers (pyarrow shard
  writers) are reported apart: they are executor-side and hold one partition at a time.
* **train**: ``training.api.train`` with ``launch.mode=in_process`` (the rank runs in the
  subprocess itself), 1 epoch, MLP [64], batch 1024, no validation, sampled the same way and
  cross-checked with ``ru_maxrss``.
* **images** (``--images``, issue 43): no shard phase; a dataset of N JPEGs (``--side`` pixels,
  ``format: keep``, written with pyarrow as benchmarks/image_loader.py writes it) trained for one
  epoch in-process (the MLP with an image stem, batch 64, 2 decode threads, augmentation on) with
  ``data.shuffle_buffer_rows=65536`` and ``data.shuffle_buffer_bytes=--buffer-mb``: the bytes bound
  is the one that ends the buffers, so the rank's peak RSS should stay within a constant plus about
  three buffers of ``--buffer-mb`` and three decoded batches, however many images there are.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

MB = 1024 * 1024


class PeakRss:
    """Peak RSS (MB) of this process, of its java descendants and of its other python
    descendants, sampled every ``interval`` seconds by a daemon thread."""

    def __init__(self, interval: float = 0.2):
        import psutil

        self.me = psutil.Process(os.getpid())
        self.interval = interval
        self.peak = {"python": 0.0, "jvm": 0.0, "driver": 0.0, "python_workers": 0.0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-rss", daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.sample()

    def _run(self):
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self):
        import psutil

        python = self.me.memory_info().rss / MB
        jvm = workers = 0.0
        for child in self.me.children(recursive=True):
            try:
                name, rss = child.name(), child.memory_info().rss / MB
            except psutil.Error:  # exited between listing and reading
                continue
            if name == "java":
                jvm += rss
            elif name.startswith("python"):
                workers += rss
        for key, value in (("python", python), ("jvm", jvm), ("driver", python + jvm), ("python_workers", workers)):
            self.peak[key] = max(self.peak[key], value)


def child_shard(rows: int, workdir: str) -> dict:
    from pipelines import generate_dataset, shard_dataset
    from pipelines.shard_config import SparkConfig
    from common.spark import get_or_create_session

    with PeakRss() as peak:
        started = time.perf_counter()
        spark = get_or_create_session(SparkConfig(master="local[2]", app_name="memory_flat",
                                                  conf={"spark.driver.memory": "2g", "spark.ui.enabled": "false"}))
        data = generate_dataset(f"{workdir}/raw", rows, spark=spark, mode="overwrite")
        generated = time.perf_counter()
        shard_dataset(data.shard_config(f"{workdir}/shards", output={"mode": "overwrite"}), spark=spark)
        done = time.perf_counter()
        spark.stop()
    return {"driver_peak_rss_mb": round(peak.peak["driver"]), "driver_jvm_peak_rss_mb": round(peak.peak["jvm"]),
            "driver_python_peak_rss_mb": round(peak.peak["python"]),
            "spark_python_workers_peak_rss_mb": round(peak.peak["python_workers"]),
            "generate_s": round(generated - started, 1), "shard_s": round(done - generated, 1)}


def child_train(workdir: str) -> dict:
    from training import load_train_config, train

    cfg = load_train_config(None, [
        f"data.path={workdir}/shards", "data.val_split=null", "model.hidden=[64]", "train.epochs=1",
        "train.batch_size=1024", "train.log_every_steps=1000000", "checkpoint.every_epochs=null",
        "checkpoint.resume=never", "launch.mode=in_process", "launch.num_proc=1", "launch.device=cpu",
        f"output.model_path={workdir}/model", "output.mode=overwrite"])
    with PeakRss() as peak:
        started = time.perf_counter()
        result = train(cfg)
        seconds = time.perf_counter() - started
    # ru_maxrss is in KiB on Linux; it covers the whole process life (imports included).
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    samples = result.metrics[-1]["samples"]
    return {"rank_peak_rss_mb": round(peak.peak["python"]), "rank_ru_maxrss_mb": round(maxrss),
            "train_rows": samples, "train_s": round(seconds, 1)}


def child_images(count: int, side: int, buffer_mb: int, workdir: str) -> dict:
    from benchmarks.image_loader import jpeg_files, published
    from training import load_train_config, train

    paths = jpeg_files(f"{workdir}/folder", count, side)
    uri = published(f"{workdir}/ds", paths, side, files=8)
    dataset_mb = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(uri) for f in files) / MB
    shutil.rmtree(f"{workdir}/folder")
    cfg = load_train_config(None, [
        f"data.path={uri}", "data.val_split=null", "data.reader=arrow", "data.shuffle_buffer_rows=65536",
        f"data.shuffle_buffer_bytes={buffer_mb * MB}", "data.decode_workers=2",
        "data.augment.photo.flip=true", "data.augment.photo.random_resized_crop.scale=[0.5,1.0]",
        "model.hidden=[16]", "model.kwargs.image_width=4", "train.epochs=1", "train.batch_size=64",
        "train.log_every_steps=1000000", "checkpoint.every_epochs=null", "checkpoint.resume=never",
        "launch.mode=in_process", "launch.num_proc=1", "launch.device=cpu", f"output.model_path={workdir}/model",
        "output.mode=overwrite"])
    with PeakRss() as peak:
        started = time.perf_counter()
        train(cfg)
        seconds = time.perf_counter() - started
    return {"images": count, "side": side, "dataset_mb": round(dataset_mb, 1), "shuffle_buffer_mb": buffer_mb,
            "rank_peak_rss_mb": round(peak.peak["python"]), "train_s": round(seconds, 1)}


def run_child(*args: str) -> dict:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *args], check=True, stdout=subprocess.PIPE,
                         text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000000,4000000", help="comma-separated row counts; the first is the base")
    parser.add_argument("--workdir", default="/tmp/memory-flat")
    parser.add_argument("--keep", action="store_true", help="keep the generated data")
    parser.add_argument("--images", help="comma-separated image counts: the images phase instead (the first is the base)")
    parser.add_argument("--side", type=int, default=96, help="the images' stored side in pixels")
    parser.add_argument("--buffer-mb", type=int, default=4, help="data.shuffle_buffer_bytes in MiB for the images phase")
    parser.add_argument("--child", choices=["shard", "train", "images"], help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child == "images":
        print(json.dumps(child_images(args.rows, args.side, args.buffer_mb, args.workdir)))
        return
    if args.images:
        base = None
        for count in (int(s) for s in args.images.split(",")):
            workdir = f"{args.workdir}/images-{count}"
            record = {"benchmark": "memory_flat_images", "cpus": os.cpu_count(),
                      **run_child("--child", "images", "--rows", str(count), "--side", str(args.side),
                                  "--buffer-mb", str(args.buffer_mb), "--workdir", workdir)}
            base = base or record
            record["images_ratio"] = round(count / base["images"], 2)
            record["rank_peak_rss_ratio"] = round(record["rank_peak_rss_mb"] / base["rank_peak_rss_mb"], 3)
            print(json.dumps(record), flush=True)
            shutil.rmtree(workdir, ignore_errors=True)
        return
    if args.child == "shard":
        print(json.dumps(child_shard(args.rows, args.workdir)))
        return
    if args.child == "train":
        print(json.dumps(child_train(args.workdir)))
        return

    import psutil

    base = None
    for rows in (int(s) for s in args.sizes.split(",")):
        workdir = f"{args.workdir}/{rows}"
        record = {"benchmark": "memory_flat", "rows": rows, "cpus": os.cpu_count(),
                  "ram_gb": round(psutil.virtual_memory().total / 1024 ** 3, 1)}
        record.update(run_child("--child", "shard", "--rows", str(rows), "--workdir", workdir))
        record.update(run_child("--child", "train", "--workdir", workdir))
        if base is None:
            base = record
        else:
            record["rows_ratio"] = round(rows / base["rows"], 2)
            for key in ("driver_peak_rss_mb", "driver_jvm_peak_rss_mb", "driver_python_peak_rss_mb",
                        "spark_python_workers_peak_rss_mb", "rank_peak_rss_mb", "rank_ru_maxrss_mb"):
                record[key.replace("_mb", "_ratio")] = round(record[key] / max(base[key], 1), 3)
        print(json.dumps(record), flush=True)
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
