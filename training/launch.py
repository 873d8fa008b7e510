"""Starting the ranks: Horovod-on-Spark (``horovod.spark.run`` on the job's SparkSession) or one
process in place, and turning what comes back into results or one typed error.

``rank_entry`` is the function shipped to executors. It is module-level (pickled by reference),
takes only the plain ``RankPlan``, and imports torch and horovod when it runs. It never lets an
exception escape: a failure comes back as a ``RankFailure`` record with the rank's own traceback,
so the driver can say what went wrong instead of showing a bare Py4JJavaError.
"""

from __future__ import annotations

import logging
import os
import re
import traceback

from common.errors import EXIT_RUNTIME, ConfigError, ShardtrainError
from common.errors import LaunchError, RankFailedError, RankFailure

log = logging.getLogger("shardtrain.train")

# Messages a rank raises because *another* rank went away: consequences, not causes.
_SECONDARY = re.compile(r"HorovodInternalError|Horovod has been shut down|Connection closed by peer|"
                        r"Gloo.*(closed|timed out)|Broken pipe|Connection reset", re.I)


def rank_entry(plan) -> dict:
    """Runs on every Horovod rank (in the process horovod.spark.run starts for a Spark task)."""
    rank = int(os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "-1")))
    try:
        from training.distributed import HorovodGroup
        from training.loop import run_rank

        group = HorovodGroup()
        rank = group.rank
        return {"ok": True, **run_rank(plan, group)}
    except BaseException as exc:  # noqa: BLE001 - reported to the driver as data, see module docstring
        text = traceback.format_exc()
        return {"ok": False, "failure": failure_record(rank, exc, text).to_dict()}


def failure_record(rank: int, exc: BaseException, text: str) -> RankFailure:
    exit_code = exc.exit_code if isinstance(exc, ShardtrainError) else EXIT_RUNTIME
    secondary = bool(_SECONDARY.search(f"{type(exc).__name__}: {exc}"))
    return RankFailure(rank=rank, type=type(exc).__name__, message=str(exc).strip().splitlines()[0] if str(exc) else "",
                       traceback=text, exit_code=exit_code, secondary=secondary)


def launch_in_process(plan, on_step=None) -> list[dict]:
    """World size 1 in this process: no Spark, no Horovod (debugging, notebooks, GPU benchmarks)."""
    from training.loop import run_rank

    return [{"ok": True, **run_rank(plan, None, on_step=on_step)}]


def launch_spark(plan, spark, launch_cfg) -> list[dict]:
    """``launch_cfg.num_proc`` ranks as Spark tasks of ``spark``'s application: Horovod, or
    torch.distributed under TorchDistributor (training.torch_launch) for launch.backend=torch."""
    if launch_cfg.backend == "torch":
        from training.torch_launch import launch_torch

        return launch_torch(plan, spark, launch_cfg)
    check_capacity(spark, launch_cfg.num_proc, launch_cfg.gpus_per_proc)
    import horovod.spark

    env = {"PYTHONUNBUFFERED": "1", **{k: str(v) for k, v in launch_cfg.env.items()}}
    try:
        results = horovod.spark.run(rank_entry, args=(plan,), num_proc=launch_cfg.num_proc,
                                    start_timeout=launch_cfg.start_timeout, env=env, verbose=launch_cfg.verbose,
                                    use_gloo=True)
    except Exception as exc:  # noqa: BLE001 - mapped to one typed error with the cause in words
        from common.spark import explain_java_error

        raise LaunchError(
            f"horovod.spark.run could not run {launch_cfg.num_proc} rank(s): {explain_java_error(exc)}. "
            "Each rank needs its own Spark task slot at the same time (executor cores / spark.task.cpus); "
            "the ranks' own output above says more") from exc
    return list(results)


def check_results(results: list[dict]) -> list[dict]:
    failures = [RankFailure(**r["failure"]) for r in results if not r.get("ok")]
    if failures:
        raise RankFailedError(failures)
    return results


def check_capacity(spark, num_proc: int, gpus_per_proc: int) -> None:
    """Refuse up front what would otherwise wait start_timeout seconds and then fail."""
    conf = spark.sparkContext.getConf()
    master = conf.get("spark.master", "")
    task_cpus = int(conf.get("spark.task.cpus", "1"))
    match = re.fullmatch(r"local\[(\d+|\*)(?:,\d+)?\]|local", master)
    if match:
        cores = 1 if master == "local" else (os.cpu_count() or 1) if match.group(1) == "*" else int(match.group(1))
        slots = cores // task_cpus
        if num_proc > slots:
            raise ConfigError(
                f"launch.num_proc={num_proc} needs {num_proc} concurrent Spark tasks, but master {master} with "
                f"spark.task.cpus={task_cpus} runs {slots}; use spark.master=local[{num_proc * task_cpus}] "
                f"or fewer ranks")
    if gpus_per_proc:
        amount = conf.get("spark.task.resource.gpu.amount", None)
        if amount is None or float(amount) < gpus_per_proc:
            raise ConfigError(
                f"launch.gpus_per_proc={gpus_per_proc} but this Spark application gives tasks "
                f"{amount or 'no'} GPUs: set spark.task.resource.gpu.amount={gpus_per_proc} (with "
                "spark.executor.resource.gpu.amount and a discovery script) in spark.conf")


__all__ = ["check_capacity", "check_results", "failure_record", "launch_in_process", "launch_spark", "rank_entry"]
