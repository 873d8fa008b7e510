"""The supervisor with Spark's own task state (common.spark.LaunchJobs), on the suite's classic
session: ranks that never reach the driver's progress server are not called stalled while Spark
runs the launch's tasks (the launch says so once), and are once those tasks are gone. Over Spark
Connect the same rule runs on the execution progress the server streams (test_connect.py)."""

from __future__ import annotations

import logging
import pytest
from pyspark import InheritableThread

from polling import wait_for
from training.launchers.supervisor import Supervision

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300), pytest.mark.stack]


def test_silent_ranks_are_not_stalled_while_spark_runs_their_tasks(spark, tmp_path, caplog):
    # The rule applies once the stall and start timeouts have passed (12 s): by then Spark runs the
    # job's two tasks on the warm session (a second or two; had it not, the supervisor would call the
    # ranks stalled and the test fails). The test waits out both timeouts, so they are no longer
    # than that margin needs.
    caplog.set_level(logging.WARNING, logger="shardtrain")
    release = str(tmp_path / "release")

    def task(_):  # a rank's task that never reports: it runs until the test releases it
        import os
        import time

        while not os.path.exists(release):
            time.sleep(0.1)

    try:
        with Supervision(spark, world=2, stall_timeout_s=4, start_timeout=8) as sup:
            # A launcher's job carries the launch's job tag, a local property of the thread that opened the
            # launch: pyspark's InheritableThread hands it to the job's thread (a plain thread's job is
            # not this launch's; test_sweep.py shows that another launch's job is left alone).
            job = InheritableThread(target=lambda: spark.range(0, 2, numPartitions=2).foreach(task), daemon=True)
            job.start()
            wait_for(lambda: sup.jobs.running_tasks() == 2, "Spark to run both tasks", timeout=60)
            said = wait_for(lambda: [r.getMessage() for r in caplog.records if "never reached" in r.getMessage()],
                            "the supervisor to say the ranks cannot reach it", timeout=180)
            assert sup.stall is None
            assert sup.jobs.running_tasks() == 2  # what it went by: Spark runs both tasks
            assert len(said) == 1 and "rank(s) 0, 1 never reached the driver's progress server" in said[0]
            open(release, "w").close()  # the tasks end: nothing runs and no rank ever reported
            job.join(timeout=120)
            wait_for(lambda: sup.stall, "the supervisor to call the silent ranks stalled", timeout=60)
    finally:
        open(release, "w").close()  # never leave the tasks holding the session's cores
    assert "rank 0 never reported" in sup.stall or "rank 1 never reported" in sup.stall
    assert sum("never reached" in r.getMessage() for r in caplog.records) == 1  # said once
