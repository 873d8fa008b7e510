"""The FT-Transformer against the MLP on the demo data, and 2 pipeline stages against DDP, in one run.

The demo's data (conf/run.yaml's features: 4 numeric, 2 categorical, an 8-float array; generated
rows sharded by the product's shard job, or ``--data`` for shards already made), trained through
``training.train`` with conf/train.yaml's settings (batch 512, bf16, AdamW, 3 epochs, seed 0) on
TorchDistributor, local[2], 2 ranks, for each of:

- ``mlp_ddp``: conf/train.yaml's MLP [128, 64], DDP (2 replicas: global batch 1024, lr x 2);
- ``ft_ddp``: ``model.name=ft_transformer`` (defaults: 4 blocks, d_model 32, 4 heads), DDP;
- ``ft_stages``: the same model in 2 pipeline stages (1F1B, 8 micro-batches), one replica (global
  batch 512), i.e. the issue's done-when command;
- ``mlp_stages``: the MLP in 2 stages.

One JSON line per run (last epoch's validation accuracy, samples/s over the epochs after the
first, the measured pipeline bubble per stage), then a summary with each run's accuracy
difference and samples/s ratio to ``ft_ddp``. The rates depend on the machine's load: read the
ratios.

    .venv/bin/python benchmarks/ft_transformer_demo.py [--rows 200000] [--data artifacts/shards] \
        [--runs mlp_ddp,ft_ddp,ft_stages,mlp_stages] [--epochs 3] [--workdir /tmp/ft-demo]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_CONF, TRAIN_CONF = os.path.join(ROOT, "conf", "run.yaml"), os.path.join(ROOT, "conf", "train.yaml")
RUNS = {
    "mlp_ddp": [],
    "ft_ddp": ["model.name=ft_transformer"],
    "ft_stages": ["model.name=ft_transformer", "train.pipeline.stages=2"],
    "mlp_stages": ["train.pipeline.stages=2"],
}


def make_dataset(spark, workdir: str, rows: int) -> str:
    from pipelines import generate_dataset, shard_dataset
    from shardtrain.run import load_run_config

    cfg = load_run_config(RUN_CONF, [f"shard.sources.raw.path={workdir}/raw", f"shard.output.path={workdir}/shards"])
    generate_dataset(f"{workdir}/raw", rows, spark=spark, seed=0, array_shape=cfg.shard.features.arrays.get("image"),
                     mode="overwrite")
    shard_dataset(cfg.shard, spark=spark)
    return f"{workdir}/shards"


def train_run(spark, data: str, workdir: str, name: str, epochs: int) -> dict:
    from training import load_model, load_train_config, train

    cfg = load_train_config(TRAIN_CONF, [
        f"data.path={data}", "launch.backend=torch", "launch.num_proc=2", f"train.epochs={epochs}",
        "train.log_every_steps=1000000", "checkpoint.every_epochs=null", "checkpoint.resume=never",
        f"output.model_path={workdir}/model-{name}", "output.mode=overwrite", *RUNS[name]])
    result = train(cfg, spark=spark)
    later = result.metrics[1:] or result.metrics
    seconds, samples = sum(m["seconds"] for m in later), sum(m["samples"] for m in later)
    bubbles = [m.get("pipeline_bubble_fraction") for m in later if m.get("pipeline_bubble_fraction")]
    params = sum(p.numel() for p in load_model(result.model_uri).module.parameters())
    return {"benchmark": "ft_transformer_demo", "run": name, "model": cfg.model.name, "parameters": params,
            "stages": cfg.train.pipeline.stages, "global_batch": cfg.train.batch_size * 2 // cfg.train.pipeline.stages,
            "epochs": epochs, "val_accuracy": round(result.final["val_accuracy"], 4),
            "baseline_accuracy": round(result.final["baseline_accuracy"], 4),
            "samples_per_s": round(samples / seconds, 1), "train_seconds": round(sum(m["seconds"] for m in result.metrics), 1),
            **({"bubble_fraction_per_stage": [round(sum(b[s] for b in bubbles) / len(bubbles), 3)
                                              for s in range(len(bubbles[0]))]} if bubbles else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--data", default=None, help="shards already made from the demo's raw data")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    from common.config import SparkConfig
    from common.spark import get_or_create_session

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    workdir = args.workdir or tempfile.mkdtemp(prefix="ft-demo-")
    spark = get_or_create_session(SparkConfig(master="local[2]", app_name="ft_transformer_demo",
                                              conf={"spark.sql.shuffle.partitions": "8"}))
    started = time.perf_counter()
    data = args.data or make_dataset(spark, workdir, args.rows)
    lines = {}
    for name in args.runs.split(","):
        lines[name] = train_run(spark, data, workdir, name, args.epochs)
        print(json.dumps(lines[name]), flush=True)
    reference = lines.get("ft_ddp")
    if reference:
        print(json.dumps({"benchmark": "ft_transformer_demo_summary", "reference": "ft_ddp", "load_average": os.getloadavg(),
                          **{name: {"accuracy_diff": round(line["val_accuracy"] - reference["val_accuracy"], 4),
                                    "samples_per_s_ratio": round(line["samples_per_s"] / reference["samples_per_s"], 3)}
                             for name, line in lines.items() if name != "ft_ddp"},
                          "seconds": round(time.perf_counter() - started, 1)}), flush=True)
    spark.stop()


if __name__ == "__main__":
    main()
