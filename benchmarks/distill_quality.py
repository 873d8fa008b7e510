"""Does distillation help here? (issue 12) Test-split accuracy of a large teacher, a small student
trained from scratch, and the same student distilled from the teacher, on one generated dataset,
in one run.

    .venv/bin/python benchmarks/distill_quality.py [--rows 60000] [--teacher 512,512,512] [--student 16]
        [--epochs 6] [--temperature 2] [--alphas 0.5,0.9] [--workdir /tmp/distill-quality]

The data is made to need capacity: 8 standard-normal features and a label that is the sign of a
random Fourier function of them (32 terms, sin(w.x + b) with w ~ N(0, 1)), written by Spark from
the seed. The pipeline is the product's: ``shardtrain distill``'s function (shard, train the
teacher, shard again with its soft targets, train the distilled student), then one student from
scratch on the teacher's dataset and more distilled students (other alphas) on the soft-target
dataset. Every model trains in process (world size 1, fp32, same seed, same epochs and batch).
Accuracy is that of ``load_model(...).predict_arrays`` on the test split (the same rows in both
datasets). Prints one JSON line per model, then one summary line: accuracies, parameters, and the
share of the teacher-scratch gap the distilled student closes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

FEATURES, TERMS, SEED = 8, 32, 0


def write_raw(spark, path: str, rows: int) -> None:
    """id, x0..x7 (standard normal, from hashes of (seed, feature, id)), label (0/1)."""
    import numpy as np

    rng = np.random.default_rng(SEED)
    w, b, c = rng.normal(0, 1, (TERMS, FEATURES)), rng.uniform(0, 2 * np.pi, TERMS), rng.normal(0, 1, TERMS)

    def uniform(stream):
        return f"((CAST(xxhash64({SEED}, {stream}, id) & 4503599627370495 AS DOUBLE) + 0.5) / 4503599627370496.0)"

    xs = [f"sqrt(-2 * ln({uniform(2 * i)})) * cos(2 * pi() * {uniform(2 * i + 1)}) AS x{i}" for i in range(FEATURES)]
    terms = [f"{c[k]!r} * sin({' + '.join(f'{w[k, i]!r} * x{i}' for i in range(FEATURES))} + {b[k]!r})"
             for k in range(TERMS)]
    frame = spark.range(rows).selectExpr("id", *xs).selectExpr("*", f"CAST(({' + '.join(terms)}) > 0 AS BIGINT) AS label")
    frame.repartition(4).write.mode("overwrite").parquet(path)


def train_section(model_path: str, hidden: list[int], epochs: int, **train) -> dict:
    return {"model": {"hidden": hidden}, "launch": {"mode": "in_process", "num_proc": 1},
            "train": {"epochs": epochs, "batch_size": 256, "lr": 0.002, "log_every_steps": 1000, **train},
            "checkpoint": {"resume": "never", "every_epochs": None}, "output": {"model_path": model_path, "mode": "overwrite"}}


def test_accuracy(model_uri: str, dataset_uri: str) -> float:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from common.dataset import read_manifest
    from training.data import columns_for, table_to_arrays
    from training.export import load_model

    manifest = read_manifest(dataset_uri)
    table = pa.concat_tables([pq.read_table(os.path.join(manifest.root.path, f.path)) for f in manifest.files("test")])
    arrays = table_to_arrays(table, columns_for(manifest))
    label = arrays.pop("label")
    arrays.pop("_row")
    return float(np.mean(load_model(model_uri).predict_arrays(arrays).argmax(axis=1) == label))


def parameters(model_uri: str) -> int:
    from training.export import load_model

    return sum(p.numel() for p in load_model(model_uri).module.parameters())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=60_000)
    parser.add_argument("--teacher", default="512,512,512")
    parser.add_argument("--student", default="16")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--temperature", type=float, default=2.0)
    parser.add_argument("--alphas", default="0.5,0.9")
    parser.add_argument("--workdir", default="/tmp/distill-quality")
    args = parser.parse_args()
    teacher_hidden = [int(h) for h in args.teacher.split(",")]
    student_hidden = [int(h) for h in args.student.split(",")]
    alphas = [float(a) for a in args.alphas.split(",")]

    from common.config import SparkConfig, from_dict
    from common.spark import get_or_create_session
    from shardtrain.distill import DistillRunConfig, distill
    from training import load_train_config, train

    spark = get_or_create_session(SparkConfig(master="local[2]", app_name="distill_quality",
                                              conf={"spark.sql.shuffle.partitions": 4}), log_level="ERROR")
    work = args.workdir
    raw = f"{work}/raw"
    write_raw(spark, raw, args.rows)
    shard = {"sources": {"raw": {"path": raw}}, "features": {"numeric": [f"x{i}" for i in range(FEATURES)]},
             "label": {"column": "label", "task": "classification", "num_classes": 2},
             "split": {"key": "id"}, "output": {"path": f"{work}/shards", "num_shards": 2, "mode": "overwrite"}}
    cfg = from_dict(DistillRunConfig, {
        "shard": shard,
        "teacher": train_section(f"{work}/teacher", teacher_hidden, args.epochs),
        "soft_targets": {"path": f"{work}/shards-teacher", "temperature": args.temperature},
        "student": train_section(f"{work}/student-a{alphas[0]}", student_hidden, args.epochs,
                                 distill={"alpha": alphas[0]}),
    })
    started = time.perf_counter()
    loop = distill(cfg, spark=spark)
    loop_seconds = time.perf_counter() - started
    plain, soft = f"{work}/shards", f"{work}/shards-teacher"

    def student(name: str, data: str, *extra: str) -> str:
        overrides = [f"data.path={data}", "launch.mode=in_process", "launch.num_proc=1", f"train.epochs={args.epochs}",
                     "train.batch_size=256", "train.lr=0.002", "train.log_every_steps=1000", "checkpoint.resume=never",
                     "checkpoint.every_epochs=null", f"model.hidden={student_hidden}",
                     f"output.model_path={work}/{name}", "output.mode=overwrite", *extra]
        return train(load_train_config(None, overrides)).model_uri

    models = {"teacher": (loop.teacher.train.model_uri, plain),
              "student_scratch": (student("student-scratch", plain), plain),
              f"student_distilled_a{alphas[0]}": (loop.student.train.model_uri, soft)}
    for alpha in alphas[1:]:
        models[f"student_distilled_a{alpha}"] = (student(f"student-a{alpha}", soft, f"train.distill.alpha={alpha}"), soft)
    results = {}
    for name, (uri, data) in models.items():
        results[name] = {"test_accuracy": round(test_accuracy(uri, data), 4), "parameters": parameters(uri)}
        print(json.dumps({"benchmark": "distill_quality", "model": name, **results[name]}), flush=True)
    teacher, scratch = results["teacher"]["test_accuracy"], results["student_scratch"]["test_accuracy"]
    gap = teacher - scratch
    print(json.dumps({
        "benchmark": "distill_quality", "rows": args.rows, "epochs": args.epochs, "temperature": args.temperature,
        "teacher_hidden": teacher_hidden, "student_hidden": student_hidden, "distill_loop_seconds": round(loop_seconds, 1),
        "accuracy": {name: r["test_accuracy"] for name, r in results.items()},
        "gap_closed": {name: round((r["test_accuracy"] - scratch) / gap, 3) if gap > 0 else None
                       for name, r in results.items() if name.startswith("student_distilled")},
    }), flush=True)


if __name__ == "__main__":
    main()
