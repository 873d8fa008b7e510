"""spark-submit entry point for training: the same code as ``shardtrain train``.

    spark-submit --master spark://HOST:7077 training/jobs/train.py --config conf/train.yaml [key=value ...]

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


def handle_train(args):
    from training.api import handle_train as handler

    return handler(args)


if __name__ == "__main__":
    sys.exit(run_job(handle_train, "training/jobs/train.py", __doc__.splitlines()[0]))
