"""spark-submit entry point for shard-then-train: the same code as ``shardtrain run``.

    spark-submit --master spark://HOST:7077 training/jobs/run.py --config conf/run.yaml [key=value ...]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from pipelines.cli import add_config_arguments, run_command, setup_logging  # noqa: E402


def main(argv=None) -> int:
    from training.api import handle_run

    parser = argparse.ArgumentParser(prog="training/jobs/run.py", description=__doc__.splitlines()[0])
    add_config_arguments(parser)
    args = parser.parse_args(argv)
    setup_logging()
    return run_command(handle_run, args)


if __name__ == "__main__":
    sys.exit(main())
