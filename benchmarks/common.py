"""What the benchmark scripts share: building (once) a sharded dataset to measure on, and timing.

Datasets are cached under --workdir keyed by their parameters, so a second run measures only.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

# petastorm 0.12 calls pyarrow APIs deprecated in 14 on every reader start; the noise hides results.
warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=DeprecationWarning)
warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def machine() -> dict:
    import torch

    return {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def sharded_dataset(workdir: str, rows: int, array_shape: list[int] | None = None, num_shards: int = 4,
                    rows_per_row_group: int | None = None, numeric: int = 16, categorical: int = 4,
                    spark=None) -> str:
    """Generate + shard (local Spark) once; returns the dataset URI."""
    from pipelines import generate_dataset, read_manifest, shard_dataset
    from pipelines.storage import is_committed

    tag = f"r{rows}-n{numeric}-c{categorical}-a{'x'.join(map(str, array_shape or [])) or 0}-s{num_shards}" \
          f"-g{rows_per_row_group or 'auto'}"
    shards = os.path.join(workdir, f"shards-{tag}")
    if is_committed(shards):
        read_manifest(shards)
        return shards
    raw = os.path.join(workdir, f"raw-{tag}")
    data = generate_dataset(raw, rows, spark=spark, numeric=numeric, categorical=categorical,
                            array_shape=array_shape, mode="overwrite")
    output = {"num_shards": num_shards, "mode": "overwrite"}
    if rows_per_row_group:
        output["rows_per_row_group"] = rows_per_row_group
    cfg = data.shard_config(shards, output=output, quality={"max_bad_fraction": 1.0},
                            spark={"conf": {"spark.driver.memory": "4g", "spark.sql.shuffle.partitions": 8}})
    shard_dataset(cfg, spark=spark)
    return shards


class Timer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start


def emit(record: dict) -> None:
    print(json.dumps(record, sort_keys=True), flush=True)
