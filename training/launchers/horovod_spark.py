"""Horovod-on-Spark: ``launch.num_proc`` ranks as Spark tasks of the job's SparkSession
(``horovod.spark.run``, gloo), and what it raises turned into one typed ``LaunchError``. With
``launch.elastic`` the launch is ``horovod.spark.run_elastic`` and the rank loop's attempts are
``training.elastic.HorovodElastic``: survivors of a dead rank go on at a smaller world size.

``rank_entry`` is the function shipped to executors: module-level (pickled by reference), given
only the plain ``RankPlan``, importing torch and horovod when it runs; the sequence around the
training is the shared ``training.launchers.rank_entry.run_rank_entry``.
"""

from __future__ import annotations

import logging
import os
import re
import signal

from common.errors import LaunchError, first_line
from common.spark import adopt_job_group
from training.launchers.base import SparkLauncher
from training.launchers.capacity import check_capacity
from training.launchers.rank_entry import run_rank_entry

log = logging.getLogger("shardtrain.train")

# horovod's gloo_run names the first rank whose process exited non-zero.
_PROCESS_EXIT = re.compile(r"The first process to do so was:\s*Process name: (\S+)\s*Exit code: (-?\d+)")


def rank_entry(plan) -> dict:
    """Runs on every Horovod rank (in the process horovod.spark.run starts for a Spark task)."""
    rank = int(os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "-1")))
    return run_rank_entry(plan, rank, _start_group, _train)


def _start_group(plan):
    from training.distributed import HorovodGroup, pick_device

    return HorovodGroup(*pick_device(int(os.environ.get("HOROVOD_RANK", "-1"))))


def _train(plan, group, reporter) -> dict:
    from training.loop import run_rank

    return run_rank(plan, group, hooks=reporter)  # with launch.elastic, its attempts are Horovod elastic's


def launch_horovod(plan, spark, launch_cfg) -> list[dict]:
    """One record per rank (``training.launchers.rank_entry``), or a ``LaunchError``."""
    check_capacity(spark, launch_cfg.num_proc, launch_cfg.gpus_per_proc)
    import horovod.spark

    adopt_job_group(_next_horovod_job_group())
    env = {"PYTHONUNBUFFERED": "1", **{k: str(v) for k, v in launch_cfg.env.items()}}
    try:
        if launch_cfg.elastic:
            # Survivors of a dead rank go on (training.elastic); Spark may re-run its task, which rejoins.
            results = horovod.spark.run_elastic(
                rank_entry, args=(plan,), num_proc=launch_cfg.num_proc, min_num_proc=launch_cfg.min_num_proc,
                max_num_proc=launch_cfg.num_proc, start_timeout=launch_cfg.start_timeout,
                elastic_timeout=launch_cfg.start_timeout, env=env, verbose=launch_cfg.verbose)
        else:
            results = horovod.spark.run(rank_entry, args=(plan,), num_proc=launch_cfg.num_proc,
                                        start_timeout=launch_cfg.start_timeout, env=env, verbose=launch_cfg.verbose,
                                        use_gloo=True)
    except Exception as exc:  # noqa: BLE001 - mapped to one typed error with the cause in words
        raise launch_error(exc, launch_cfg.num_proc) from exc
    return list(results)


def _next_horovod_job_group() -> str:
    """The Spark job group the next horovod.spark.run(_elastic) submits its job under, on a thread of
    its own that this launch's job tag (common.spark.LaunchJobs) does not reach. Horovod numbers its
    groups with a process-wide counter and offers no way to name one; the counter is exact here
    because Horovod launches only from the main thread (its signal handlers), one at a time."""
    from horovod.spark.driver import job_id

    with job_id.LOCK:
        return f"horovod.spark.run.{job_id.JOB_ID + 1}"


def launch_error(exc: BaseException, num_proc: int) -> LaunchError:
    """What horovod.spark.run raised, in words: which rank's process died and how, or what is missing."""
    from common.spark import explain_java_error

    text = str(exc)
    died = _PROCESS_EXIT.search(text)
    if died:
        rank, code = died.group(1), int(died.group(2))
        return LaunchError(f"training failed on rank {rank}: its process exited with {describe_exit(code)}; "
                           "the rank's own output above says more", rank_lost=True)
    if "Timed out waiting for" in text:
        return LaunchError(
            f"horovod.spark.run could not start {num_proc} rank(s): {first_line(exc)}. Each rank needs its own "
            "Spark task slot at the same time (executor cores / spark.task.cpus); raise launch.start_timeout if "
            "executors are allocated on demand")
    return LaunchError(f"horovod.spark.run failed running {num_proc} rank(s): {explain_java_error(exc)}; the "
                       "ranks' own output above says more", rank_lost=True)


def describe_exit(code: int) -> str:
    """An exit status as a person reads it: 137 and -9 are both 'killed by SIGKILL'."""
    number = -code if code < 0 else code - 128 if code > 128 else 0
    if number:
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        why = " (out of memory, or killed by someone)" if name == "SIGKILL" else ""
        return f"status {code}: killed by {name}{why}"
    return f"status {code}"


class HorovodSparkLauncher(SparkLauncher):
    """``launch.backend=horovod``: Horovod's ranks, elastic or not; only on classic Spark."""

    ranks = "horovod"
    elastic = True
    classic_only = "Horovod-on-Spark needs a SparkContext, RDDs and job groups"

    def launch_ranks(self, plan, spark, launch_cfg) -> list[dict]:
        return launch_horovod(plan, spark, launch_cfg)


__all__ = ["HorovodSparkLauncher", "describe_exit", "launch_error", "launch_horovod", "rank_entry"]
