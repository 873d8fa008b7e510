"""`shardtrain score` throughput vs ``load_model(uri).predict`` in one pandas process, on the same rows,
and the scoring core's mapInArrow against pyspark's ``predict_batch_udf``, measured side by side.

    .venv/bin/python benchmarks/score_throughput.py --rows 1000000

Setup (not timed): generate ``--rows`` raw rows with Spark (4 numeric, 2 categorical, an 8-float
array, 0.01% bad rows), train a model in-process on a 20k-row sample sharded by the shard job
(MLP ``--hidden``), then time, on the same raw Parquet:

  - ``score_job``: run_score_job on local[N] (count per reason, score, write scores + quarantine,
    check the accounting, publish), first in the session, then again (``score_job_warm``: Python
    workers started, torch imported, the model loaded);
  - ``pandas``: read the Parquet, drop the bad rows (checked over Arrow with pyarrow.compute), to
    pandas, then ``load_model(uri).predict`` on all rows in one process (its whole-frame FeatureSpec.transform, one forward pass per --batch-size rows),
    with torch's default intra-op threads and with 1 (what Spark gives each task); the ratio uses
    the faster;
  - ``pandas_predict_and_write``: the same with 1 torch thread, also writing what the job writes
    (``id``, ``probabilities``, ``prediction`` to one Parquet file; the bad rows to another): what a
    user would otherwise run end to end (ratio ``score_job_warm_vs_pandas_write``);
  - ``map_in_arrow``: scoring.predict.predict_frame over the clean rows into Spark's ``noop`` sink
    (the model loaded once per Python worker; what the job runs);
  - ``predict_batch_udf``: the same model and preprocessing through
    ``pyspark.ml.functions.predict_batch_udf`` (one column per feature, numpy batches, a struct of
    probabilities and prediction), into the ``noop`` sink.

The two core variants run interleaved, best of ``--repeats``. ``rows_per_s`` counts every input
row. Prints one JSON line per measurement and a final line of ratios (``score_job_vs_pandas`` and
``score_job_warm_vs_pandas`` > 1: Spark is faster; ``map_in_arrow_vs_predict_batch_udf`` > 1:
mapInArrow is faster).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.config import from_dict  # noqa: E402
from pipelines.generate import generate_dataset  # noqa: E402
from pipelines.shard_config import ShardConfig  # noqa: E402
from pipelines.shard_job import run_shard_job  # noqa: E402
from scoring.config import load_score_config  # noqa: E402
from scoring.job import run_score_job  # noqa: E402
from scoring.predict import predict_frame  # noqa: E402
from training import load_model, load_train_config, train  # noqa: E402

FEATURES = ["x0", "x1", "x2", "x3", "c0", "c1", "image"]


def spark_session(master: str):
    from common.config import SparkConfig
    from common.spark import get_or_create_session

    conf = {"spark.sql.shuffle.partitions": 8, "spark.ui.enabled": False, "spark.driver.memory": "4g"}
    return get_or_create_session(SparkConfig(master=master, app_name="score-throughput", conf=conf), log_level="ERROR")


def train_model(spark, work: Path, hidden: list[int]) -> str:
    sample = generate_dataset(spark, str(work / "sample"), 20_000, seed=1, array_shape=[8], mode="overwrite")
    shard_cfg = from_dict(ShardConfig, sample.shard_config(str(work / "shards"), output={"num_shards": 2,
                                                                                   "mode": "overwrite"}))
    run_shard_job(spark, shard_cfg)
    cfg = load_train_config(None, [f"data.path={work / 'shards'}", "launch.mode=in_process", "launch.num_proc=1",
                                   f"output.model_path={work / 'model'}", "output.mode=overwrite", "train.epochs=1", "train.batch_size=256",
                                   f"model.hidden={json.dumps(hidden)}", "data.reader=arrow"])
    return train(cfg).model_uri


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_score_job(spark, model: str, raw: str, out: str, batch_size: int) -> tuple[float, int]:
    cfg = load_score_config(None, [f"model={model}", f"sources.raw.path={raw}", f"output.path={out}",
                                   "output.mode=overwrite", "output.keep_columns=[id]", f"batch_size={batch_size}"])
    result = {}
    seconds = timed(lambda: result.setdefault("r", run_score_job(spark, cfg)))
    return seconds, result["r"].scored_rows


def time_pandas(model_uri: str, raw: str, batch_size: int, torch_threads: int,
                out: str | None = None) -> tuple[float, int]:
    """One process: read, drop bad rows, predict; with ``out``, also write what the job writes (the
    kept ``id`` column, ``probabilities`` and ``prediction`` to one Parquet file, the bad rows to another)."""
    import torch

    torch.set_num_threads(torch_threads)

    def run():
        table = read_raw(raw)
        keep = clean_mask(table)
        frame = table.filter(keep).to_pandas()
        model = load_model(model_uri)
        arrays = model.features.transform(frame)
        outputs = [model.predict_arrays({k: v[start:start + batch_size] for k, v in arrays.items()})
                   for start in range(0, len(frame), batch_size)]
        if out is not None:
            write_pandas_scores(out, frame["id"].to_numpy(), np.concatenate(outputs), table.filter(~keep))
        run.rows = len(frame)

    return timed(run), run.rows


def write_pandas_scores(out: str, ids, probabilities, bad_rows) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    Path(out).mkdir(parents=True, exist_ok=True)
    width = probabilities.shape[1]
    scores = pa.table({
        "id": pa.array(ids),
        "probabilities": pa.FixedSizeListArray.from_arrays(pa.array(probabilities.reshape(-1)), width).cast(
            pa.list_(pa.float32())),
        "prediction": pa.array(probabilities.argmax(axis=1).astype(np.int64)),
    })
    pq.write_table(scores, f"{out}/scores.parquet")  # snappy, as Spark writes
    pq.write_table(bad_rows, f"{out}/quarantine.parquet")


def read_raw(raw: str):
    import pyarrow.parquet as pq

    return pq.read_table(raw)


def clean_mask(table):
    """The rows the job keeps (it quarantines a null or non-8-float image, an image element that is
    null or not finite, a non-finite x0): checked over Arrow columns (pyarrow.compute)."""
    import pyarrow.compute as pc

    image = table.column("image").combine_chunks()
    shaped = pc.fill_null(pc.equal(pc.list_value_length(image), 8), False)
    elements_ok = pc.and_kleene(pc.is_valid(image.flatten()), pc.is_finite(image.flatten()))
    bad_elements = np.bincount(pc.list_parent_indices(image).to_numpy(), minlength=len(image),
                               weights=~elements_ok.to_numpy(zero_copy_only=False)) > 0
    x0 = table.column("x0")
    x0_ok = pc.fill_null(pc.is_finite(x0), True).to_numpy(zero_copy_only=False)  # null is imputed
    return shaped.to_numpy(zero_copy_only=False) & ~bad_elements & x0_ok


def torch_default_threads() -> int:
    import torch

    return torch.get_num_threads()


def clean_rows(spark, model_uri: str, raw: str):
    from scoring.predict import reason_sql

    df = spark.read.parquet(raw)
    spec = load_model(model_uri).features
    reason = reason_sql({f.name: f.dataType for f in df.schema.fields}, spec)
    return df.where(f"({reason}) IS NULL")


def time_map_in_arrow(spark, model_uri: str, raw: str, batch_size: int) -> float:
    frame = predict_frame(clean_rows(spark, model_uri, raw), model_uri, keep_columns=["id"], batch_size=batch_size)
    return timed(lambda: frame.write.format("noop").mode("overwrite").save())


def time_predict_batch_udf(spark, model_uri: str, raw: str, batch_size: int) -> float:
    from pyspark.ml.functions import predict_batch_udf
    from pyspark.sql import functions as F
    from pyspark.sql.types import ArrayType, FloatType, LongType, StructField, StructType

    def make_predict_fn():
        import pandas as pd

        model = load_model(model_uri)  # once per Python worker (predict_batch_udf caches the predict fn)

        def predict(x0, x1, x2, x3, c0, c1, image):
            frame = pd.DataFrame({"x0": x0, "x1": x1, "x2": x2, "x3": x3, "c0": c0, "c1": c1, "image": list(image)})
            probs = model.predict(frame)
            return {"probabilities": probs, "prediction": probs.argmax(axis=1).astype(np.int64)}

        return predict

    schema = StructType([StructField("probabilities", ArrayType(FloatType())), StructField("prediction", LongType())])
    udf = predict_batch_udf(make_predict_fn, return_type=schema, batch_size=batch_size,
                            input_tensor_shapes=[None, None, None, None, None, None, [8]])
    df = clean_rows(spark, model_uri, raw).selectExpr(
        "id", *[f"CASE WHEN isnan(CAST(x{i} AS DOUBLE)) THEN NULL ELSE CAST(x{i} AS DOUBLE) END AS x{i}" for i in range(4)],
        "CAST(c0 AS STRING) AS c0", "CAST(c1 AS STRING) AS c1", "transform(image, v -> CAST(v AS FLOAT)) AS image")
    frame = df.select("id", udf(*[F.col(c) for c in FEATURES]).alias("s"))
    return timed(lambda: frame.write.format("noop").mode("overwrite").save())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--hidden", default="[64, 64]", help="the model's hidden layers (JSON list)")
    parser.add_argument("--repeats", type=int, default=2, help="mapInArrow / predict_batch_udf runs, best taken")
    parser.add_argument("--bad-rows", type=int, default=None,
                        help="rows the job quarantines (default: one per 10,000; 0: a clean input, no quarantine pass)")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="score-bench-"))
    spark = spark_session(args.master)
    try:
        model = train_model(spark, work, json.loads(args.hidden))
        data = generate_dataset(spark, str(work / "raw"), args.rows, seed=2, array_shape=[8],
                                bad_rows=max(1, args.rows // 10_000) if args.bad_rows is None else args.bad_rows,
                                mode="overwrite")
        common = {"rows": args.rows, "master": args.master, "batch_size": args.batch_size, "hidden": args.hidden}
        job_s, scored = time_score_job(spark, model, data.path, str(work / "scores"), args.batch_size)
        print(json.dumps({"what": "score_job", **common, "scored_rows": scored, "seconds": round(job_s, 2),
                          "rows_per_s": round(data.rows / job_s)}), flush=True)
        # Again, in the same session: Python workers already started, torch imported, model loaded.
        warm_s, _ = time_score_job(spark, model, data.path, str(work / "scores"), args.batch_size)
        print(json.dumps({"what": "score_job_warm", **common, "seconds": round(warm_s, 2),
                          "rows_per_s": round(data.rows / warm_s)}), flush=True)
        # Spark gives each Python worker OMP_NUM_THREADS = spark.task.cpus (1): one torch thread per
        # task. The pandas process is measured with torch's default threads and with 1 (on a loaded
        # machine, intra-op threads that spin-wait can make the forward pass many times slower).
        default_threads = torch_default_threads()
        pandas_s = float("inf")
        for threads in sorted({default_threads, 1}, reverse=True):
            seconds, pandas_rows = time_pandas(model, data.path, args.batch_size, threads)
            pandas_s = min(pandas_s, seconds)
            print(json.dumps({"what": "pandas_load_model_predict", **common, "torch_threads": threads,
                              "scored_rows": pandas_rows, "seconds": round(seconds, 2),
                              "rows_per_s": round(data.rows / seconds)}), flush=True)
        # What a user would otherwise run end to end: the same process, also writing the scores and
        # the bad rows to Parquet (one file each), as the job does. One torch thread, as Spark's tasks.
        write_s, _ = time_pandas(model, data.path, args.batch_size, 1, out=str(work / "pandas-scores"))
        print(json.dumps({"what": "pandas_predict_and_write", **common, "torch_threads": 1,
                          "seconds": round(write_s, 2), "rows_per_s": round(data.rows / write_s)}), flush=True)
        # Interleaved, best of --repeats: the machine is shared, so the order must not favour either.
        arrow_s = udf_s = float("inf")
        for _ in range(args.repeats):
            arrow_s = min(arrow_s, time_map_in_arrow(spark, model, data.path, args.batch_size))
            udf_s = min(udf_s, time_predict_batch_udf(spark, model, data.path, args.batch_size))
        print(json.dumps({"what": "map_in_arrow", **common, "seconds": round(arrow_s, 2),
                          "rows_per_s": round(data.rows / arrow_s)}), flush=True)
        print(json.dumps({"what": "predict_batch_udf", **common, "seconds": round(udf_s, 2),
                          "rows_per_s": round(data.rows / udf_s)}), flush=True)
        print(json.dumps({"what": "ratios", **common, "score_job_vs_pandas": round(pandas_s / job_s, 2),
                          "score_job_warm_vs_pandas": round(pandas_s / warm_s, 2),
                          "score_job_warm_vs_pandas_write": round(write_s / warm_s, 2),
                          "map_in_arrow_vs_predict_batch_udf": round(udf_s / arrow_s, 2)}), flush=True)
    finally:
        spark.stop()
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
