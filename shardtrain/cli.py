"""The ``shardtrain`` command (also the spark-submit job file, through shardtrain/job.py).

Each stage registers its own commands; handlers are imported when their command runs, so
``shardtrain doctor`` still works when, say, Horovod is broken.

Exit status: 0 ok, 1 the run failed (may be retried), 2 bad usage/config/input (fix, then re-run).
"""

from __future__ import annotations

import argparse
import sys

from common import __version__
from common.cli import add_config_arguments, log_job_start, run_command, setup_logging


def _train(args):
    from training.api import handle_train

    return handle_train(args)


def _report(args):
    from training.report import handle_report

    return handle_report(args)


def _run(args):
    from shardtrain.run import handle_run

    return handle_run(args)


def _sweep(args):
    from shardtrain.sweep import handle_sweep

    return handle_sweep(args)


def _score(args):
    from scoring.job import handle_score

    return handle_score(args)


def _distill(args):
    from shardtrain.distill import handle_distill

    return handle_distill(args)


def _demo(args):
    from shardtrain.demo import handle_demo

    return handle_demo(args)


def _teacher_scorer():
    from shardtrain.teacher import teacher_scorer

    return teacher_scorer()


def _doctor(args):
    from shardtrain.doctor import run_doctor

    return run_doctor(as_json=args.json, skip_launch=args.no_launch)


def build_parser() -> argparse.ArgumentParser:
    from pipelines.commands import register_commands

    parser = argparse.ArgumentParser(
        prog="shardtrain", description="Raw data on Spark -> balanced Parquet shards -> Horovod PyTorch training.")
    parser.add_argument("--version", action="version", version=f"shardtrain {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging, and Spark's own logging (quiet otherwise)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    register_commands(sub, teacher_scorer=_teacher_scorer)  # generate, shard, inspect

    p = sub.add_parser("train", help="train a model from a published dataset (Horovod on Spark)")
    add_config_arguments(p)
    p.set_defaults(handler=_train)

    p = sub.add_parser("report", help="write a training run directory's report.html (charts, throughput, config)")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a training run directory (output.run_dir: <model_path>.run)")
    p.add_argument("--output", "-o", default=None, metavar="FILE", help="where to write it (default: RUN_DIR/report.html)")
    p.set_defaults(handler=_report)

    p = sub.add_parser("run", help="shard, then train, in one Spark application")
    add_config_arguments(p)
    p.set_defaults(handler=_run)

    p = sub.add_parser("sweep", help="many training configs over one sharded dataset, drawn and pruned by Optuna")
    add_config_arguments(p)
    p.set_defaults(handler=_sweep)

    p = sub.add_parser("score", help="score raw data (or a dataset split) with a published model, on Spark")
    add_config_arguments(p)
    p.set_defaults(handler=_score)

    p = sub.add_parser("distill", help="train a teacher, shard with its soft targets, train a student from them")
    add_config_arguments(p)
    p.set_defaults(handler=_distill)

    p = sub.add_parser("demo", help="generate data, shard it on local Spark, train 2 ranks, print a summary")
    p.add_argument("--workdir", default="artifacts", help="where data, shards and the model go (default: artifacts)")
    p.add_argument("--rows", type=int, default=200_000, help="rows of generated data (default: 200000)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="override conf/run.yaml values (e.g. train.epochs=5)")
    p.set_defaults(handler=_demo)

    p = sub.add_parser("doctor", help="check Python, Java, Spark, pyarrow/petastorm, torch, Horovod, the executors")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--no-launch", action="store_true",
                   help="skip the checks that start Spark work (executors importing shardtrain, the 2-rank "
                        "Horovod-on-Spark allreduce)")
    p.set_defaults(handler=_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    return run_command(_announce_then(args.handler), args)


def _announce_then(handler):
    """The handler, preceded for job commands by their first log line (version, config fingerprint)."""
    def announced(args) -> int:
        cfg = _job_config(args)
        if cfg is not None:
            log_job_start(args.command, cfg, args.config, args.overrides)
        return handler(args)

    return announced


def _job_config(args):
    # Loading is cheap and pure, so the handler loading it again gets the same config; a config
    # error surfaces here, before anything starts, exactly as it would in the handler. The demo
    # announces its own (conf/run.yaml with its paths).
    if args.command == "shard":
        from pipelines.shard_config import load_shard_config

        return load_shard_config(args.config, args.overrides)
    if args.command == "train":
        from training.config import load_train_config

        return load_train_config(args.config, args.overrides)
    if args.command == "score":
        from scoring.config import load_score_config

        return load_score_config(args.config, args.overrides)
    if args.command == "run":
        from shardtrain.run import load_run_config

        return load_run_config(args.config, args.overrides)
    if args.command == "sweep":
        from shardtrain.sweep_config import load_sweep_config

        return load_sweep_config(args.config, args.overrides)
    if args.command == "distill":
        from shardtrain.distill import load_distill_config

        return load_distill_config(args.config, args.overrides)
    return None


if __name__ == "__main__":
    sys.exit(main())
