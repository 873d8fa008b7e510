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


def setup_logging(verbose: bool = False) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("py4j", "petastorm", "botocore", "s3fs", "urllib3", "fsspec"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


__all__ = ["EXIT_RUNTIME", "EXIT_USAGE", "add_config_arguments", "run_command", "setup_logging"]
