"""Command-line plumbing shared by every shardtrain command and job file.

Each command is a function ``handler(args) -> int``. ``run_command`` turns the errors we raise
on purpose into one clear line on stderr and the exit status of their class (2 = usage/config,
1 = runtime); anything else gets its traceback, since it is a bug or an environment failure.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable

from pipelines.errors import EXIT_RUNTIME, EXIT_USAGE, ShardtrainError

log = logging.getLogger("shardtrain")


def add_config_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument("--config", "-c", required=required, metavar="FILE", help="YAML config file (see conf/)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="override config values")


def run_command(handler: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    try:
        return int(handler(args) or 0)
    except ShardtrainError as exc:
        print(f"shardtrain: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("shardtrain: interrupted", file=sys.stderr)
        return 130


def run_job(handler: Callable[[argparse.Namespace], int], prog: str, description: str,
            argv: list[str] | None = None) -> int:
    """What every spark-submit job file does: ``--config FILE [key=value ...] [-v]``, then the
    handler, with the same errors and exit codes as the ``shardtrain`` command."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_config_arguments(parser)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    return run_command(handler, args)


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("py4j", "petastorm", "botocore", "s3fs", "urllib3", "fsspec"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    for handler in logging.getLogger().handlers:
        handler.addFilter(_drop_py4j_reconnect)


def _drop_py4j_reconnect(record: logging.LogRecord) -> bool:
    # py4j logs this (with a traceback, on the root logger) each time it finds a pooled connection
    # closed by the JVM and transparently retries on a new one: routine during horovod.spark.run,
    # alarming to read, and never the cause of a failure (a real failure raises).
    return not (record.levelno <= logging.INFO and record.getMessage() == "Exception while sending command.")


def register_commands(subparsers) -> None:
    """Add ``generate``, ``shard`` and ``inspect``; each sets ``handler`` (args -> exit code)."""
    p = subparsers.add_parser("generate", help="write a synthetic dataset with Spark (for demos, tests, benchmarks)")
    p.add_argument("output", metavar="PATH", help="where to write it (local path, file://, s3://, hdfs://)")
    p.add_argument("--rows", type=int, default=200_000, help="number of rows (default: 200000)")
    p.add_argument("--format", choices=["parquet", "csv", "json"], default="parquet")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--numeric", type=int, default=4, help="numeric columns x0.. (default: 4)")
    p.add_argument("--categorical", type=int, default=2, help="categorical columns c0.. (default: 2)")
    p.add_argument("--vocab-size", type=int, default=20, help="distinct values per categorical column")
    p.add_argument("--array-shape", default=None, metavar="DxD",
                   help="add an array column 'image' of this shape, e.g. 8 or 4x4 (not for csv)")
    p.add_argument("--task", choices=["classification", "regression"], default="classification")
    p.add_argument("--num-classes", type=int, default=2)
    p.add_argument("--null-fraction", type=float, default=0.05)
    p.add_argument("--bad-rows", type=int, default=0, help="inject this many bad rows (for quarantine tests)")
    p.add_argument("--partitions", type=int, default=None, help="output files (default: 1 per million rows, >= 2)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument("--master", default=None, help="Spark master when no session exists (default: local[2])")
    p.set_defaults(handler=handle_generate)

    p = subparsers.add_parser("shard", help="sources -> preprocessing -> balanced Parquet shards + manifest")
    add_config_arguments(p)
    p.set_defaults(handler=handle_shard)

    p = subparsers.add_parser("inspect", help="print a dataset's manifest summary, shard balance and quarantine")
    p.add_argument("dataset", metavar="DATASET", help="URI of a published dataset")
    p.set_defaults(handler=handle_inspect)


def handle_generate(args: argparse.Namespace) -> int:
    from pipelines.errors import ConfigError
    from pipelines.generate import generate_dataset
    from pipelines.shard_config import SparkConfig
    from pipelines.spark import get_or_create_session

    shape = None
    if args.array_shape:
        try:
            shape = [int(d) for d in str(args.array_shape).lower().replace(",", "x").split("x")]
        except ValueError:
            raise ConfigError(f"--array-shape must look like 8 or 4x4, got {args.array_shape!r}") from None
    spark = get_or_create_session(SparkConfig(master=args.master) if args.master else None)
    data = generate_dataset(
        spark, args.output, args.rows, seed=args.seed, format=args.format, numeric=args.numeric,
        categorical=args.categorical, vocab_size=args.vocab_size, array_shape=shape, task=args.task,
        num_classes=args.num_classes, null_fraction=args.null_fraction, bad_rows=args.bad_rows,
        partitions=args.partitions, mode="overwrite" if args.overwrite else "error")
    print(f"wrote {data.rows:,} rows ({data.format}) to {data.path}; schema: {data.schema_ddl}")
    if data.bad_by_reason:
        print("injected bad rows: " + ", ".join(f"{k}={v}" for k, v in data.bad_by_reason.items()))
    return 0


def handle_shard(args: argparse.Namespace) -> int:
    from pipelines import shard_dataset

    result = shard_dataset(args.config, args.overrides)
    manifest = result.manifest
    what = "unchanged, skipped" if result.skipped else "published"
    splits = ", ".join(f"{s}={manifest.rows(s):,}" for s in manifest.split_names)
    quarantined = (manifest.data.get("quarantine") or {}).get("rows", 0)
    print(f"{what} {result.uri}: {splits}; quarantined {quarantined:,}; fingerprint {manifest.fingerprint[:12]}")
    return 0


def handle_inspect(args: argparse.Namespace) -> int:
    from pipelines.inspect import describe_dataset

    print(describe_dataset(args.dataset))
    return 0


__all__ = ["EXIT_RUNTIME", "EXIT_USAGE", "add_config_arguments", "register_commands", "run_command", "run_job",
           "setup_logging"]
