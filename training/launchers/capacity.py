"""The Spark application's task slots and GPUs, checked before any rank is started: what would
otherwise wait ``launch.start_timeout`` seconds and then fail is refused at once (exit 2); and the
error of a barrier job that could not get its slots after all, in words. Shared by the Spark
launchers (Horovod-on-Spark, TorchDistributor, torch_tasks); driver side."""

from __future__ import annotations

import os
import re

from common.errors import ConfigError, LaunchError
from common.spark import spark_setting


def task_slots(spark) -> tuple[str, int, int] | None:
    """(master, spark.task.cpus, concurrent tasks) of a local-mode application; None elsewhere,
    where executors come and go (dynamic allocation) and their slots cannot be counted up front."""
    master = spark_setting(spark, "spark.master", "") or ""
    task_cpus = int(spark_setting(spark, "spark.task.cpus", "1") or 1)
    match = re.fullmatch(r"local\[(\d+|\*)(?:,\d+)?\]|local", master)
    if not match:
        return None
    cores = 1 if master == "local" else (os.cpu_count() or 1) if match.group(1) == "*" else int(match.group(1))
    return master, task_cpus, cores // task_cpus


def check_capacity(spark, num_proc: int, gpus_per_proc: int) -> None:
    """Refuse up front what would otherwise wait start_timeout seconds and then fail."""
    slots_known = task_slots(spark)
    if slots_known:
        master, task_cpus, slots = slots_known
        if num_proc > slots:
            raise ConfigError(
                f"launch.num_proc={num_proc} needs {num_proc} concurrent Spark tasks, but master {master} with "
                f"spark.task.cpus={task_cpus} runs {slots}; use spark.master=local[{num_proc * task_cpus}] "
                f"or fewer ranks")
    if gpus_per_proc:
        amount = spark_setting(spark, "spark.task.resource.gpu.amount")
        if amount is None or float(amount) < gpus_per_proc:
            raise ConfigError(
                f"launch.gpus_per_proc={gpus_per_proc} but this Spark application gives tasks "
                f"{amount or 'no'} GPUs: set spark.task.resource.gpu.amount={gpus_per_proc} (with "
                "spark.executor.resource.gpu.amount and a discovery script) in spark.conf")


def barrier_slots_error(text: str, who: str, num_proc: int) -> LaunchError | None:
    """A LaunchError naming what each rank needs, where ``text`` (a failed barrier job's error in
    words) says Spark could not give the barrier stage its slots; None for any other failure."""
    if "barrier" in text.lower() and "slots" in text.lower():
        return LaunchError(f"{who} could not start {num_proc} rank(s): {text}. Each rank needs its own Spark task "
                           "slot at the same time (barrier stage: executor cores / spark.task.cpus)")
    return None


__all__ = ["barrier_slots_error", "check_capacity", "task_slots"]
