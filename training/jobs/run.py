"""spark-submit entry point for shard-then-train: the same code as ``shardtrain run``.

    spark-submit --master spark://HOST:7077 training/jobs/run.py --config conf/run.yaml [key=value ...]

Executors import ``training`` (and any plug-in model module) from the Python they run: install
shardtrain there, or ship it with ``--py-files``.
"""

import os
import sys

try:
    import training  # noqa: F401
except ImportError:  # run from a checkout without an install: the repository root is two levels up
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from pipelines.cli import run_job  # noqa: E402


def handle_run(args):
    from training.api import handle_run as handler

    return handler(args)


if __name__ == "__main__":
    sys.exit(run_job(handle_run, "training/jobs/run.py", __doc__.splitlines()[0]))
