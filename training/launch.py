"""Starting the ranks: Horovod-on-Spark (``horovod.spark.run`` on the job's SparkSession) or one
process in place, and turning what comes back into results or one typed error.

``rank_entry`` is the function shipped to executors. It is module-level (pickled by reference),
takes only the plain ``RankPlan``, and imports torch and horovod when it runs. It never lets an
exception escape: a failure comes back as a ``RankFailure`` record with the rank's own traceback,
so the driver can say what went wrong instead of showing a bare Py4JJavaError. While it trains it
reports its step to the driver (``training.supervisor.Reporter``), which stops a stalled launch and
relaunches after a rank's process died. With ``launch.elastic`` the launch is
``horovod.spark.run_elastic`` and the rank runs ``training.elastic.run_rank_elastic``.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import traceback

from common.errors import EXIT_RUNTIME, ConfigError, ShardtrainError, first_line
from common.errors import LaunchError, RankFailedError, RankFailure

log = logging.getLogger("shardtrain.train")

# Messages a rank raises because *another* rank went away: consequences, not causes.
_SECONDARY = re.compile(r"HorovodInternalError|Horovod has been shut down|Connection closed by peer|"
                        r"Gloo.*(closed|timed out)|Timed out waiting|Broken pipe|Connection reset", re.I)
# horovod's gloo_run names the first rank whose process exited non-zero.
_PROCESS_EXIT = re.compile(r"The first process to do so was:\s*Process name: (\S+)\s*Exit code: (-?\d+)")


def rank_entry(plan) -> dict:
    """Runs on every Horovod rank (in the process horovod.spark.run starts for a Spark task)."""
    from training.supervisor import Reporter

    rank = int(os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "-1")))
    reporter = Reporter.from_env(rank, plan.steps_per_epoch)
    try:
        from training.distributed import HorovodGroup
        from training.elastic import run_rank_elastic
        from training.loop import run_rank

        group = HorovodGroup()
        rank = group.rank
        run = run_rank_elastic if plan.config.launch.elastic else run_rank
        hooks = {"on_step": reporter.on_step, "on_validation": reporter.on_validation}
        if not plan.config.launch.elastic:  # an elastic run writes no report and tracks nothing after its publish
            hooks["on_published"] = reporter.on_published
        result = {"ok": True, **run(plan, group, **hooks)}
        _test_kill_after_publish(rank)
        reporter.finished(None)
        return result
    except BaseException as exc:  # noqa: BLE001 - reported to the driver as data, see module docstring
        record = failure_record(rank, exc, traceback.format_exc())
        reporter.finished(f"{record.type}: {record.message}", record.secondary)
        return {"ok": False, "failure": record.to_dict()}


def _test_kill_after_publish(rank: int) -> None:
    """Fault injection for tests/training/test_failures.py: with ``SHARDTRAIN_TEST_KILL_AFTER_PUBLISH``
    naming a file that does not exist yet, rank 0 writes its pid there and kills itself (SIGKILL)
    just after publishing the model: the one moment a test cannot reliably hit from outside."""
    flag = os.environ.get("SHARDTRAIN_TEST_KILL_AFTER_PUBLISH")
    if rank != 0 or not flag or os.path.exists(flag):
        return
    with open(flag, "w") as fh:
        fh.write(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGKILL)


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


def launch_error(exc: BaseException, num_proc: int) -> LaunchError:
    """What horovod.spark.run raised, in words: which rank's process died and how, or what is missing."""
    from common.spark import explain_java_error

    text = str(exc)
    died = _PROCESS_EXIT.search(text)
    if died:
        rank, code = died.group(1), int(died.group(2))
        return LaunchError(f"training failed on rank {rank}: its process exited with {describe_exit(code)}; "
                           "the rank's own output above says more", retryable=True)
    if "Timed out waiting for" in text:
        return LaunchError(
            f"horovod.spark.run could not start {num_proc} rank(s): {first_line(exc)}. Each rank needs its own "
            "Spark task slot at the same time (executor cores / spark.task.cpus); raise launch.start_timeout if "
            "executors are allocated on demand")
    return LaunchError(f"horovod.spark.run failed running {num_proc} rank(s): {explain_java_error(exc)}; the "
                       "ranks' own output above says more", retryable=True)


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


__all__ = ["check_capacity", "check_results", "describe_exit", "failure_record", "launch_error", "launch_in_process",
           "launch_spark", "rank_entry"]
