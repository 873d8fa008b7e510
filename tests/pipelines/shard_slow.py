"""A transform that passes rows through unchanged but holds each partition at a gate, so a test
can kill an executor while a task of the shard job is provably running on it. Shipped to
spark-submit with --py-files.

The gate is the directory named by SHARDTRAIN_TEST_GATE (read on the driver, where the transform
is built, and shipped to the tasks in the closure). Each partition, as it starts, writes a
``started-*.pid`` file holding its Python worker's pid, then waits until a ``release`` file appears
there, or GATE_TIMEOUT_S passes so that a broken test cannot hold the job forever. Once released,
later partitions (and the job's later passes over the input) go straight through.
"""

import os

GATE_ENV = "SHARDTRAIN_TEST_GATE"
RELEASE = "release"
GATE_TIMEOUT_S = 600


def gated(df):
    gate = os.environ[GATE_ENV]

    def held(batches):
        import os
        import time
        import uuid

        marker = os.path.join(gate, f"started-{uuid.uuid4().hex}.pid")
        with open(marker + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(marker + ".tmp", marker)  # atomic: a reader never sees an empty marker
        deadline = time.monotonic() + GATE_TIMEOUT_S
        while not os.path.exists(os.path.join(gate, RELEASE)) and time.monotonic() < deadline:
            time.sleep(0.1)  # polls the release file
        yield from batches

    return df.mapInArrow(held, df.schema)
