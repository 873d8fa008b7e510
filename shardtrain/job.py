"""spark-submit entry point for every shardtrain command: the same parser, code and exit status
as the ``shardtrain`` command, with the session (and its --master, --conf) from spark-submit.

    spark-submit --master spark://HOST:7077 shardtrain/job.py shard --config conf/shard.yaml [key=value ...]
    spark-submit --master spark://HOST:7077 shardtrain/job.py train --config conf/train.yaml
    spark-submit --master spark://HOST:7077 shardtrain/job.py run   --config conf/run.yaml
    spark-submit --master spark://HOST:7077 shardtrain/job.py score --config conf/score.yaml
    spark-submit --master spark://HOST:7077 shardtrain/job.py distill --config conf/distill.yaml

Executors import shardtrain (and any plug-in module) from the Python they run: install it in that
environment (our venv installs it editable; point PYSPARK_PYTHON at it), or ship it with --py-files.
"""

import os
import sys

try:
    import shardtrain.cli  # noqa: F401 - installed (or on PYTHONPATH)
except ImportError:
    # Run from a checkout without an install: spark-submit put this file's folder first on
    # sys.path; the repository root (one level up) is what holds the packages.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shardtrain.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
