"""spark-submit entry point for the shard job: the same code as ``shardtrain shard``.

    spark-submit --master spark://host:7077 pipelines/jobs/shard.py --config conf/shard.yaml [key=value ...]

The session comes from spark-submit (its --master and --conf win over the config's spark
section). Executors import ``pipelines`` from the Python they run: install shardtrain into that
environment (our venv installs it editable; point PYSPARK_PYTHON at it), or ship it with
``--py-files``.
"""

from __future__ import annotations

import argparse
import os
import sys

try:
    import pipelines  # noqa: F401
except ImportError:  # run from a checkout without an install: the repository root is two levels up
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from pipelines.cli import add_config_arguments, handle_shard, run_command, setup_logging  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pipelines/jobs/shard.py", description=__doc__.splitlines()[0])
    add_config_arguments(parser)
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    return run_command(handle_shard, args)


if __name__ == "__main__":
    sys.exit(main())
