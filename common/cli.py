"""Command-line plumbing shared by every shardtrain command (and so by the spark-submit job file).

Each command is a function ``handler(args) -> int``. ``run_command`` turns the errors we raise
on purpose into one clear line on stderr and the exit status of their class (2 = usage/config,
1 = runtime); anything else gets its traceback, since it is a bug or an environment failure.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable

from common import __version__
from common.config import config_fingerprint
from common.errors import ShardtrainError

log = logging.getLogger("shardtrain")


def add_config_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument("--config", "-c", required=required, metavar="FILE", help="YAML config file (see conf/)")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="override config values")


def log_job_start(command: str, cfg, config_source: str | None, overrides: list[str] | None = None) -> None:
    """A job's first log line: what ran (version, command, config file, overrides and the resolved
    config's fingerprint), so a scheduler's log alone says which code and config produced a run."""
    source = " ".join([config_source or "<defaults>", *(overrides or [])])
    log.info("shardtrain %s %s: config %s; fingerprint %s", __version__, command, source, config_fingerprint(cfg))


def run_command(handler: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    try:
        return int(handler(args) or 0)
    except ShardtrainError as exc:
        print(f"shardtrain: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("shardtrain: interrupted", file=sys.stderr)
        return 130


def setup_logging(verbose: bool = False) -> None:
    """Our log lines on stderr (INFO; DEBUG when verbose). Verbose also gives Spark's JVM its own
    logging back (common.spark quiets it by default)."""
    from common.spark import set_spark_verbose

    set_spark_verbose(verbose)
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


__all__ = ["add_config_arguments", "log_job_start", "run_command", "setup_logging"]
