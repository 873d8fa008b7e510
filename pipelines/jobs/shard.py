"""spark-submit entry point for the shard job: the same code as ``shardtrain shard``.

    spark-submit --master spark://host:7077 pipelines/jobs/shard.py --config conf/shard.yaml [key=value ...]

The session comes from spark-submit (its --master and --conf win over the config's spark
section). Executors import ``pipelines`` from the Python they run: install shardtrain into that
environment (our venv installs it editable; point PYSPARK_PYTHON at it), or ship it with
``--py-files``.
"""

import os
import sys

try:
    import pipelines  # noqa: F401
except ImportError:  # run from a checkout without an install: the repository root is two levels up
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from pipelines.cli import handle_shard, run_job  # noqa: E402

if __name__ == "__main__":
    sys.exit(run_job(handle_shard, "pipelines/jobs/shard.py", __doc__.splitlines()[0]))
