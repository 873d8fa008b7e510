"""The pipeline stage's commands: ``generate``, ``shard`` and ``inspect``.

``register_commands`` adds them to the ``shardtrain`` parser (shardtrain/cli.py); each sets
``handler`` (args -> exit status). Handlers import what they run lazily, so ``shardtrain --help``
stays fast and Spark-free.
"""

from __future__ import annotations

import argparse

from common.cli import add_config_arguments
from common.tasks import LABEL_TASKS


def register_commands(subparsers, teacher_scorer=None) -> None:
    """Add ``generate``, ``shard`` and ``inspect``; each sets ``handler`` (args -> exit code).
    ``teacher_scorer``: a function returning the pipelines.teacher.TeacherScorer that runs a shard
    config's ``teacher`` (called when ``shard`` runs). The shardtrain layer passes it, since
    pipelines never imports the scoring code it is built on."""
    p = subparsers.add_parser("generate", help="write a synthetic dataset with Spark (for demos, tests, benchmarks)")
    p.add_argument("output", metavar="PATH", help="where to write it (local path, file://, s3://, hdfs://)")
    p.add_argument("--rows", type=int, default=200_000, help="number of rows (default: 200000)")
    p.add_argument("--format", choices=["parquet", "csv", "json"], default="parquet",
                   help="the files' format (default: parquet); csv and json have records that do not parse among "
                        "the --bad-rows")
    p.add_argument("--seed", type=int, default=0, help="every value is a function of (seed, id) (default: 0)")
    p.add_argument("--numeric", type=int, default=4, help="numeric columns x0.. (default: 4)")
    p.add_argument("--categorical", type=int, default=2, help="categorical columns c0.. (default: 2)")
    p.add_argument("--vocab-size", type=int, default=20, help="distinct values per categorical column")
    p.add_argument("--array-shape", default=None, metavar="DxD",
                   help="add an array column 'image' of this shape, e.g. 8 or 4x4 (not for csv)")
    p.add_argument("--text", action="store_true",
                   help="add a text column 'review' (a few words, one of which the label depends on)")
    p.add_argument("--task", choices=list(LABEL_TASKS), default="classification",
                   help="what the label is (default: classification)")
    p.add_argument("--num-classes", type=int, default=2, help="classes of the label (default: 2)")
    p.add_argument("--null-fraction", type=float, default=0.05,
                   help="share of null values in each feature column (default: 0.05)")
    p.add_argument("--bad-rows", type=int, default=0, help="inject this many bad rows (for quarantine tests)")
    p.add_argument("--partitions", type=int, default=None, help="output files (default: 1 per million rows, >= 2)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument("--master", default=None, help="Spark master when no session exists (default: local[2])")
    p.set_defaults(handler=handle_generate)

    p = subparsers.add_parser("shard", help="sources -> preprocessing -> balanced Parquet shards + manifest")
    add_config_arguments(p)
    p.set_defaults(handler=handle_shard, teacher_scorer=teacher_scorer)

    p = subparsers.add_parser("inspect", help="print a dataset's manifest summary, shard balance and quarantine")
    p.add_argument("dataset", metavar="DATASET", help="URI of a published dataset")
    p.add_argument("--verify", action="store_true",
                   help="also read every file and check it against the manifest's sha256 (exit 2 if any differs)")
    p.add_argument("--html", default=None, metavar="OUT.html",
                   help="also write the report as one self-contained HTML file with charts (any storage URI)")
    p.set_defaults(handler=handle_inspect)


def handle_generate(args: argparse.Namespace) -> int:
    from common.config import SparkConfig
    from common.errors import ConfigError
    from common.spark import get_or_create_session
    from pipelines.generate import generate_dataset

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
        partitions=args.partitions, mode="overwrite" if args.overwrite else "error", text=args.text)
    print(f"wrote {data.rows:,} rows ({data.format}) to {data.path}; schema: {data.schema_ddl}")
    if data.bad_by_reason:
        print("injected bad rows: " + ", ".join(f"{k}={v}" for k, v in data.bad_by_reason.items()))
    return 0


def handle_shard(args: argparse.Namespace) -> int:
    from pipelines import shard_dataset

    make_scorer = getattr(args, "teacher_scorer", None)
    result = shard_dataset(args.config, args.overrides, teacher_scorer=make_scorer() if make_scorer else None)
    manifest = result.manifest
    what = "unchanged, skipped" if result.skipped else "published"
    splits = ", ".join(f"{s}={manifest.rows(s):,}" for s in manifest.split_names)
    quarantined = (manifest.data.get("quarantine") or {}).get("rows", 0)
    transfer = (f"; transfer {manifest.label.transfer_rows:,} (train rows without a label)"
                if manifest.label.transfer_rows else "")
    print(f"{what} {result.uri}: {splits}; quarantined {quarantined:,}{transfer}; "
          f"fingerprint {manifest.fingerprint[:12]}")
    return 0


def handle_inspect(args: argparse.Namespace) -> int:
    from common.dataset import read_manifest
    from pipelines.describe import describe_dataset, verify_report

    manifest = read_manifest(args.dataset)
    print(describe_dataset(manifest))
    if getattr(args, "html", None):
        from pipelines.describe import write_dataset_report

        print(f"\nwrote {write_dataset_report(manifest, args.html)}")
    if getattr(args, "verify", False):
        from common.errors import DatasetError

        report, problems = verify_report(manifest)
        print(report)
        if problems:
            raise DatasetError(f"{manifest.root.uri}: {problems} file(s) do not match the manifest (listed above); "
                               "re-run the shard job")
    return 0


__all__ = ["handle_generate", "handle_inspect", "handle_shard", "register_commands"]
