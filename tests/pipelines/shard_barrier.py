"""A transform that holds a shard job at a known point (tests of concurrent writers): it records
that it was reached, then waits until the test releases it. Both are files in the directory
named by SHARDTRAIN_TEST_BARRIER, so the test waits on what it can observe, not on time."""

import os
import time


def hold(df):
    barrier = os.environ["SHARDTRAIN_TEST_BARRIER"]
    with open(os.path.join(barrier, f"reached-{os.getpid()}"), "w") as fh:
        fh.write("reached")
    deadline = time.monotonic() + 600
    while not os.path.exists(os.path.join(barrier, "release")):
        if time.monotonic() > deadline:
            raise TimeoutError("the test never released the barrier")
        time.sleep(0.05)
    return df
