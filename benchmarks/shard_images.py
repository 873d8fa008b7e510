"""The shard job on a folder of JPEGs, against a plain Spark ``binaryFile`` read -> Parquet write of
the same files, in one warm session.

    .venv/bin/python benchmarks/shard_images.py --workdir /tmp/shard-images
    .venv/bin/python benchmarks/shard_images.py --workdir /tmp/shard-images --images 4000 --side 256 --repeats 5
    .venv/bin/python benchmarks/shard_images.py --workdir /tmp/shard-images --classes auto

The input (``--images`` JPEGs of ``--side`` x ``--side`` pixels at quality 90, smooth gradients
with noise so they compress like photos, in 4 class folders) is written once under ``--workdir``
and reused by later runs with the same workdir and sizes. One local[2] session is started and
each path run once untimed (warm-up); then, alternating, ``--repeats`` times each:

  - ``plain``: ``spark.read.format("binaryFile").load(folder).select("path", "content")
    .repartition(n).write.parquet(out)``, n = splits x shards: the bytes copied, nothing checked;
  - ``keep``: ``run_shard_job`` with ``features.images.content: {size: [S, S], format: keep}``
    (S = ``--size``), labels from the folder names (``--classes named``: the 4 names; ``auto``:
    fitted on train, which decodes every image once more): every image decoded and resized once to
    check it, the original bytes stored, mean/std fitted on up to 512 train images, balanced shards;
  - ``jpeg``: the same with ``format: jpeg``: the checked pixels re-encoded at S x S and stored.

One JSON line: the median and every time of each path, ``keep_ratio`` = plain / keep median
seconds (the goal: at least 0.5), ``jpeg_ratio`` = plain / jpeg, ``resize_cost_s`` = jpeg - keep
medians (what re-encoding at size adds over storing the originals; both decode and resize once to
check), the input's and each output's bytes, and the images per second of each path.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CLASSES = ("cat", "dog", "fox", "owl")
SPLITS = {"train": 0.8, "val": 0.1, "test": 0.1}
NUM_SHARDS = 2


def spark_session():
    from common.config import SparkConfig
    from common.spark import get_or_create_session

    conf = {"spark.sql.shuffle.partitions": 8, "spark.ui.enabled": False, "spark.driver.memory": "2g"}
    return get_or_create_session(SparkConfig(master="local[2]", app_name="shard-images", conf=conf), log_level="ERROR")


def write_folder(root: Path, images: int, side: int) -> Path:
    """``images`` JPEGs in class folders under ``root/jpeg-<images>-<side>`` (once)."""
    import numpy as np
    from PIL import Image

    folder = root / f"jpeg-{images}-{side}"
    done = folder / "_DONE"
    if done.exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 1, side, dtype=np.float32)
    for i in range(images):
        name = CLASSES[i % len(CLASSES)]
        (folder / name).mkdir(parents=True, exist_ok=True)
        a, b, c = rng.uniform(0, 255, 3)
        base = np.stack([a * ramp[None, :] + 0 * ramp[:, None], b * ramp[:, None] + 0 * ramp[None, :],
                         np.full((side, side), c, np.float32)], axis=-1)
        pixels = np.clip(base + rng.normal(0, 12, (side, side, 3)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / name / f"{i:06d}.jpg", quality=90)
    done.write_text("")
    return folder


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def plain(spark, folder: Path, out: Path) -> None:
    from common.spark import to_spark_path

    (spark.read.format("binaryFile").option("recursiveFileLookup", "true").option("pathGlobFilter", "*.jpg")
     .load(to_spark_path(str(folder))).select("path", "content")
     .repartition(len(SPLITS) * NUM_SHARDS).write.mode("overwrite").parquet(to_spark_path(str(out))))


def job(spark, folder: Path, out: Path, fmt: str, size: int, classes: str) -> None:
    from common.config import from_dict
    from pipelines.shard_config import ShardConfig
    from pipelines.shard_job import run_shard_job

    cfg = from_dict(ShardConfig, {
        "sources": {"pics": {"path": str(folder), "format": "binaryFile",
                             "options": {"recursiveFileLookup": True, "pathGlobFilter": "*.jpg"}}},
        "query": "SELECT path, content, regexp_extract(path, '/([^/]+)/[^/]+$', 1) AS label FROM pics",
        "features": {"images": {"content": {"size": [size, size], "format": fmt}}},
        "label": {"column": "label", "classes": "auto" if classes == "auto" else sorted(CLASSES)},
        "split": {"key": "regexp_extract(path, '[^/]+/[^/]+$', 0)", "fractions": SPLITS},
        "output": {"path": str(out), "num_shards": NUM_SHARDS, "mode": "overwrite"}})
    run_shard_job(spark, cfg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--side", type=int, default=256, help="the JPEGs' side in pixels")
    parser.add_argument("--size", type=int, default=224, help="features.images.content.size (square)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--classes", choices=["auto", "named"], default="named",
                        help="label.classes: auto (fitted: every image decoded twice) or the 4 names (once)")
    args = parser.parse_args()

    root = Path(args.workdir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    folder = write_folder(root, args.images, args.side)
    spark = spark_session()
    paths = {"plain": lambda out: plain(spark, folder, out),
             "keep": lambda out: job(spark, folder, out, "keep", args.size, args.classes),
             "jpeg": lambda out: job(spark, folder, out, "jpeg", args.size, args.classes)}
    for name, run in paths.items():  # warm-up, untimed
        run(root / f"out-{name}")
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(args.repeats):
        for name, run in paths.items():
            start = time.perf_counter()
            run(root / f"out-{name}")
            times[name].append(round(time.perf_counter() - start, 3))
    median = {name: statistics.median(t) for name, t in times.items()}
    print(json.dumps({
        "images": args.images, "side": args.side, "size": args.size, "classes": args.classes,
        "input_bytes": folder_bytes(folder),
        "median_s": median, "times_s": times,
        "keep_ratio": round(median["plain"] / median["keep"], 3),
        "jpeg_ratio": round(median["plain"] / median["jpeg"], 3),
        "resize_cost_s": round(median["jpeg"] - median["keep"], 3),
        "images_per_s": {name: round(args.images / m, 1) for name, m in median.items()},
        "output_bytes": {name: folder_bytes(root / f"out-{name}") for name in paths},
    }))
    spark.stop()


if __name__ == "__main__":
    main()
