"""Text features (issue 44): the share of pad tokens per batching, and the shard job's tokenization
against a plain Spark pandas UDF calling the same tokenizer's ``encode_batch``.

    .venv/bin/python benchmarks/text_padding.py --workdir /tmp/text-bench
    .venv/bin/python benchmarks/text_padding.py --workdir /tmp/text-bench --rows 200000 --skip-spark

1. Padding (no Spark): token lengths drawn from a log-normal fitted to the figures in
   docs FIELD_NOTES (median 13 tokens, p95 29, a long tail; synthetic: no labelled text corpus is
   on this machine's registries), ``--batch`` rows per batch. Pad share = pad tokens / all
   positions over one epoch, for: ``max_tokens`` (every row padded to max_tokens, what a fixed
   shape needs), ``random`` (shuffled batches padded to their longest row: what the loader does
   now, ``data.batching.pad_multiple: 1``) and ``buckets`` (rows sorted by length into batches:
   what length buckets, issue 44's ``data.batching.by: tokens``, not built yet, would reach).
2. Tokenization (``--skip-spark`` skips it): ``pipelines.generate --text`` rows; one warm local[2]
   session; alternating, ``--repeats`` times: ``job`` = ``run_shard_job`` with the review as the
   only feature (tokenizer given as a file, so both sides use the same one and the job fits
   nothing), ``udf`` = ``spark.read.parquet(raw).select(id, label, encode(review)).write.parquet``
   with a pandas UDF calling ``encode_batch``. Ratio = median udf seconds / median job seconds
   (the goal: at least 0.8).
One JSON line per part.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def pad_shares(rows: int, batch: int, max_tokens: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    # log-normal with median 13 and p95 29: sigma = ln(29/13) / 1.645
    lengths = np.maximum(1, np.round(rng.lognormal(np.log(13), np.log(29 / 13) / 1.645, rows))).astype(np.int64)
    lengths = np.minimum(lengths, max_tokens)  # truncate: head
    full = rows // batch * batch

    def share(batches: np.ndarray) -> float:
        positions = (batches.max(axis=1) * batch).sum()
        return float(1 - batches.sum() / positions)

    shuffled = rng.permutation(lengths)[:full].reshape(-1, batch)
    ordered = np.sort(lengths)[:full].reshape(-1, batch)
    return {"part": "padding", "rows": rows, "batch": batch, "max_tokens": max_tokens,
            "median_tokens": float(np.median(lengths)), "p95_tokens": float(np.percentile(lengths, 95)),
            "pad_share": {"max_tokens": round(float(1 - lengths[:full].sum() / (full * max_tokens)), 4),
                          "random": round(share(shuffled), 4), "buckets": round(share(ordered), 4)}}


def tokenization(workdir: str, rows: int, repeats: int) -> dict:
    import shutil

    import pyarrow as pa
    from pyspark.sql.functions import pandas_udf

    from common.config import SparkConfig, from_dict
    from common.spark import get_or_create_session
    from common.tokenizer import TextEncoder, train_tokenizer
    from pipelines.generate import generate_dataset
    from pipelines.shard_config import ShardConfig
    from pipelines.shard_job import run_shard_job

    spark = get_or_create_session(SparkConfig(master="local[2]", conf={"spark.sql.shuffle.partitions": 8,
                                                                        "spark.ui.enabled": False}),
                                  log_level="ERROR")
    raw = os.path.join(workdir, f"raw-{rows}")
    if not os.path.exists(raw):
        generate_dataset(spark, raw, rows, numeric=1, categorical=0, text=True)
    tokenizer_path = os.path.join(workdir, "tokenizer.json")
    sample = [r["review"] for r in spark.read.parquet(raw).select("review").limit(50_000).collect()]
    with open(tokenizer_path, "w", encoding="utf-8") as fh:
        fh.write(train_tokenizer(iter(sample), "wordpiece", 2000, True))
    tokenizer_json = open(tokenizer_path, encoding="utf-8").read()

    def job(out: str) -> None:
        cfg = from_dict(ShardConfig, {
            "sources": {"raw": {"path": raw, "format": "parquet"}},
            "features": {"text": {"review": {"tokenizer": {"file": tokenizer_path}, "max_tokens": 64}}},
            "label": {"column": "label", "num_classes": 2}, "split": {"key": "id"},
            "output": {"path": out, "num_shards": 4, "mode": "overwrite"}})
        run_shard_job(spark, cfg)

    @pandas_udf("array<int>")
    def encode(texts):
        import pandas as pd

        encoder = TextEncoder(tokenizer_json, 64, "head")
        return pd.Series([encoder.truncated(ids) for ids in encoder.token_ids(texts.fillna("").tolist())])

    def udf(out: str) -> None:
        (spark.read.parquet(raw).select("id", "label", encode("review").alias("review"))
         .write.mode("overwrite").parquet(out))

    times = {"job": [], "udf": []}
    for name, run in (("job", job), ("udf", udf)):  # warm-up, not timed
        run(os.path.join(workdir, f"warm-{name}"))
    for _ in range(repeats):
        for name, run in (("job", job), ("udf", udf)):
            out = os.path.join(workdir, f"out-{name}")
            shutil.rmtree(out, ignore_errors=True)
            start = time.perf_counter()
            run(out)
            times[name].append(round(time.perf_counter() - start, 2))
    job_s, udf_s = statistics.median(times["job"]), statistics.median(times["udf"])
    return {"part": "tokenization", "rows": rows, "times": times, "job_s": job_s, "udf_s": udf_s,
            "ratio": round(udf_s / job_s, 3), "pyarrow": pa.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-spark", action="store_true")
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    print(json.dumps(pad_shares(args.rows, args.batch, args.max_tokens, seed=0)), flush=True)
    if not args.skip_spark:
        print(json.dumps(tokenization(args.workdir, args.rows, args.repeats)), flush=True)


if __name__ == "__main__":
    main()
