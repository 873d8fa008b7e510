"""Starting the ranks: one ``launch(plan, spark)`` for every way a run is launched.

- ``in_process`` (``launch.mode=in_process``): world size 1 in the driver's process.
- ``horovod_spark`` (``launch.backend=horovod``): Horovod-on-Spark, elastic or not.
- ``torch_distributor`` (``launch.backend=torch``): torch.distributed under TorchDistributor.
- ``torch_tasks`` (``launch.backend=torch_tasks``): torch.distributed ranks inside the barrier tasks'
  own Python workers (no torchrun; torch stays imported for the session's next launch).
- ``torchrun`` (``launch.backend=torchrun``): no Spark; this process is one rank a launcher outside
  Spark started (torchrun, Kubernetes, Databricks serverless GPU), and rank 0 also the driver.

A Spark launch runs under the driver's ``supervisor`` (progress reports, stall timeout, relaunches)
and its ``failure_policy`` (retry or raise, one pure rule set). Every Spark rank runs the one
rank-entry sequence of ``rank_entry`` and reports through ``progress.Reporter``. Adding a launcher
is one module with a ``launch_fn(plan, spark, launch_cfg) -> list[dict]`` and an entry in
``SPARK_LAUNCHERS``; a launcher whose processes are started from outside (each one rank) is one
module with ``launch_fn(plan, launch_cfg) -> list[dict]`` and ``coordinates(launch_cfg) -> bool``
(whether this process is also the run's driver), optionally ``run_id(launch_cfg) -> str | None``
(the id all its processes share, restarts included), and an entry in ``RANK_LAUNCHERS``.

Layering inside the package (no module imports one that imports it back): ``failure_policy`` and
``progress`` import only ``common``; ``rank_entry`` imports those two; the launchers import
``rank_entry`` and ``capacity``; ``supervisor`` imports ``failure_policy``, ``progress`` and
``rank_entry``; this module imports the supervisor and the launchers lazily, so a rank importing
``training.launchers.rank_entry`` does not import the driver side.
"""

from __future__ import annotations

from typing import Callable

# launch.backend -> "module:function" of its launch_fn, imported when used (horovod and pyspark's
# TorchDistributor are optional).
SPARK_LAUNCHERS = {
    "horovod": "training.launchers.horovod_spark:launch_horovod",
    "torch": "training.launchers.torch_distributor:launch_torch",
    "torch_tasks": "training.launchers.torch_tasks:launch_torch_tasks",
}

# launch.backend -> the module of a launcher outside Spark (its launch_fn and coordinates).
RANK_LAUNCHERS = {
    "torchrun": "training.launchers.torchrun:launch_torchrun",
}


# Backends that need classic Spark (a SparkContext, RDDs, job groups): refused under Spark Connect.
CLASSIC_ONLY = {"horovod": "Horovod-on-Spark needs a SparkContext, RDDs and job groups"}


def spark_launcher(backend: str) -> Callable:
    """The ``launch_fn`` of ``launch.backend``."""
    return _imported(SPARK_LAUNCHERS[backend])


def _imported(target: str, name: str | None = None):
    import importlib

    module, _, default = target.partition(":")
    return getattr(importlib.import_module(module), name or default)


def needs_spark(launch_cfg) -> bool:
    """Whether the run's ranks are started on Spark (so the driver needs a session)."""
    return launch_cfg.mode != "in_process" and launch_cfg.backend in SPARK_LAUNCHERS


def coordinates_run(launch_cfg) -> bool:
    """Whether this process is the run's driver (the writer lock, the reader lease, the output
    checks, the summary): every process but the ranks other than 0 of a launcher outside Spark."""
    if launch_cfg.mode == "in_process" or launch_cfg.backend not in RANK_LAUNCHERS:
        return True
    return _imported(RANK_LAUNCHERS[launch_cfg.backend], "coordinates")(launch_cfg)


def launch_run_id(launch_cfg) -> str | None:
    """The run id every process of one launch outside Spark shares, restarts included (the
    launcher's ``run_id(launch_cfg)``, where it has one); None: the run id is the process's own."""
    if launch_cfg.mode == "in_process" or launch_cfg.backend not in RANK_LAUNCHERS:
        return None
    module = __import__(RANK_LAUNCHERS[launch_cfg.backend].partition(":")[0], fromlist=["run_id"])
    return getattr(module, "run_id", lambda _cfg: None)(launch_cfg)


def launch(plan, spark=None, on_step: Callable[[int], None] | None = None,
           on_restart: Callable[[int, str], None] | None = None,
           on_epoch: Callable[[dict], bool] | None = None) -> list[dict]:
    """Every rank's result (rank 0 first), or one typed error. ``plan.config.launch`` picks the
    launcher; ``spark`` is the job's session (unused in-process). ``on_step`` (in-process only) sees
    each step; ``on_restart(restart, reason)`` runs before each relaunch of the Spark ranks;
    ``on_epoch(record)``, on the driver, gets rank 0's record of each epoch and returns whether the
    run stops there (every launcher: in-process directly, Spark ranks through the supervisor)."""
    from training.launchers.rank_entry import check_results

    cfg = plan.config
    if cfg.launch.mode == "in_process":
        from training.launchers.in_process import launch_in_process

        return check_results(launch_in_process(plan, on_step=on_step, on_epoch=on_epoch))
    if cfg.launch.backend in RANK_LAUNCHERS:
        return check_results(_imported(RANK_LAUNCHERS[cfg.launch.backend])(plan, cfg.launch))
    from common.spark import check_paths_reach_cluster
    from training.launchers.supervisor import run_supervised

    check_backend_runs(cfg.launch.backend, spark)
    check_paths_reach_cluster(cfg, spark)  # the ranks read and write through the cluster
    results = run_supervised(spark_launcher(cfg.launch.backend), plan, spark, cfg.launch, cfg.checkpoint.resume,
                             on_restart=on_restart, on_epoch=on_epoch)
    return check_results(results)


def backend_for(launch_cfg, spark):
    """``launch_cfg`` with the backend this session runs: where ``launch.backend`` was left unset
    (horovod where installed) and the session is Spark Connect, which Horovod-on-Spark cannot run
    on, torch (unless ``launch.elastic``, which only Horovod offers: then exit 2 as for an explicit
    choice). Anything else unchanged."""
    import dataclasses

    from common.spark import is_connect

    if not (getattr(launch_cfg, "backend_auto", False) and launch_cfg.backend in CLASSIC_ONLY
            and not launch_cfg.elastic and spark is not None and is_connect(spark)):
        return launch_cfg
    import logging

    logging.getLogger("shardtrain.train").info(
        "launch.backend is not set and this is a Spark Connect session: the ranks run on torch (TorchDistributor), "
        "as %s cannot run here", launch_cfg.backend)
    return dataclasses.replace(launch_cfg, backend="torch")


def check_backend_runs(backend: str, spark) -> None:
    """Refuse (exit 2) a backend the session cannot run, before any rank starts."""
    from common.spark import is_connect

    if backend in CLASSIC_ONLY and spark is not None and is_connect(spark):
        from common.errors import ConfigError

        runs = ", ".join(sorted(set(SPARK_LAUNCHERS) - set(CLASSIC_ONLY)))
        raise ConfigError(f"launch.backend={backend} cannot run on this Spark Connect session "
                          f"({CLASSIC_ONLY[backend]}, which Spark Connect does not offer): set launch.backend={runs}, "
                          "or run on a classic Spark session (a dedicated access mode cluster on Databricks)")


__all__ = ["CLASSIC_ONLY", "RANK_LAUNCHERS", "SPARK_LAUNCHERS", "backend_for", "check_backend_runs", "coordinates_run", "launch",
           "launch_run_id", "needs_spark", "spark_launcher"]
