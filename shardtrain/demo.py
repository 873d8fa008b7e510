"""``make demo``: generate a synthetic dataset, shard it on local Spark, train two Horovod ranks
with bf16 for a few epochs, publish the model under ``<workdir>/model`` and print a summary with
the validation metric against the trivial baseline. Uses conf/run.yaml, so the demo is exactly
``shardtrain run --config conf/run.yaml`` on freshly generated data.
"""

from __future__ import annotations

import argparse
import os
import sys

CONF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf", "run.yaml")
DEMO_ROWS = 200_000


def run_demo(workdir: str = "artifacts", overrides: list[str] | None = None, rows: int = DEMO_ROWS, spark=None):
    from common.cli import log_job_start
    from pipelines.generate import ARRAY_COLUMN, generate_dataset
    from common.spark import get_or_create_session
    from shardtrain.run import load_run_config, run

    workdir = os.path.abspath(workdir)
    paths = [f"shard.sources.raw.path={workdir}/raw", f"shard.output.path={workdir}/shards",
             f"train.output.model_path={workdir}/model"]
    cfg = load_run_config(CONF, [*paths, *(overrides or [])])
    log_job_start("demo", cfg, CONF, overrides)
    spark = spark or get_or_create_session(cfg.shard.spark)
    # The raw data has every column the example configs declare (conf/shard.yaml reads it as is).
    array_shape = cfg.shard.features.arrays.get(ARRAY_COLUMN)
    print(f"[demo] generating {rows} rows at {workdir}/raw", flush=True)
    generate_dataset(spark, f"{workdir}/raw", rows, seed=0, array_shape=array_shape, mode="overwrite")
    print("[demo] sharding, then training "
          f"{cfg.train.launch.num_proc} Horovod rank(s) with {cfg.train.train.precision}", flush=True)
    result = run(cfg, spark)
    print("\n" + "=" * 72 + "\n" + result.summary() + "\n" + "=" * 72, flush=True)
    return result


def handle_demo(args) -> int:
    run_demo(getattr(args, "workdir", "artifacts"), getattr(args, "overrides", []), getattr(args, "rows", DEMO_ROWS))
    return 0


def main(argv: list[str] | None = None) -> int:
    from common.cli import run_command, setup_logging

    parser = argparse.ArgumentParser(prog="python -m shardtrain.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="artifacts")
    parser.add_argument("--rows", type=int, default=DEMO_ROWS)
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="override conf/run.yaml values")
    args = parser.parse_args(argv)
    setup_logging()
    return run_command(handle_demo, args)


if __name__ == "__main__":
    sys.exit(main())
