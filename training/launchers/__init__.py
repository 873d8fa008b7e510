"""Starting the ranks: one ``launch(plan, spark)`` for every way a run is launched, each a
``training.launchers.base.Launcher`` named in ``LAUNCHERS``.

- ``in_process`` (``launch.mode=in_process``, whatever ``launch.backend`` says): world size 1 in
  the driver's process.
- ``horovod_spark`` (``launch.backend=horovod``): Horovod-on-Spark, elastic or not.
- ``torch_distributor`` (``launch.backend=torch``): torch.distributed under TorchDistributor.
- ``torch_tasks`` (``launch.backend=torch_tasks``): torch.distributed ranks inside the barrier tasks'
  own Python workers (no torchrun; torch stays imported for the session's next launch).
- ``torchrun`` (``launch.backend=torchrun``): no Spark; this process is one rank a launcher outside
  Spark started (torchrun, Kubernetes, Databricks serverless GPU), and rank 0 also the driver.

A Spark launch runs under the driver's ``supervisor`` (progress reports, stall timeout, relaunches)
and its ``failure_policy`` (retry or raise, one pure rule set). Every Spark rank runs the one
rank-entry sequence of ``rank_entry`` and reports through ``progress.Reporter``. Adding a launcher
is one module with a ``Launcher`` subclass (``base``: a ``SparkLauncher`` gives its
``launch_ranks(plan, spark, launch_cfg) -> list[dict]``; one whose processes are started from
outside, each one rank, says which of them ``coordinates`` the run and its ``run_id``) and one
line in ``LAUNCHERS``: ``launch.backend``'s choices, the config check and the strategies it offers
follow from it.

Layering inside the package (no module imports one that imports it back): ``failure_policy`` and
``progress`` import only ``common``; ``rank_entry`` imports those two; ``base`` imports this module
and the supervisor lazily; the launchers import ``base``, ``rank_entry`` and ``capacity``;
``supervisor`` imports ``failure_policy``, ``progress`` and ``rank_entry``; this module imports the
launchers by their ``LAUNCHERS`` line and the supervisor through them, so a rank importing
``training.launchers.rank_entry`` does not import the driver side.
"""

from __future__ import annotations

import functools
from typing import Callable

# name -> "module:Class" of its Launcher, imported when used (horovod and pyspark's TorchDistributor
# are optional: a launcher module imports them when it launches).
LAUNCHERS = {
    "horovod": "training.launchers.horovod_spark:HorovodSparkLauncher",
    "torch": "training.launchers.torch_distributor:TorchDistributorLauncher",
    "torch_tasks": "training.launchers.torch_tasks:TorchTasksLauncher",
    "torchrun": "training.launchers.torchrun:TorchrunLauncher",
    "in_process": "training.launchers.in_process:InProcessLauncher",
}
# launch.mode=in_process (the documented spelling) picks this one whatever launch.backend says;
# launch.backend names any other.
IN_PROCESS = "in_process"
BACKENDS = tuple(name for name in LAUNCHERS if name != IN_PROCESS)  # launch.backend's choices


def launcher_name(launch_cfg) -> str:
    """The ``LAUNCHERS`` name of the launcher ``launch_cfg`` (the config's launch section) picks."""
    return IN_PROCESS if launch_cfg.mode == IN_PROCESS else launch_cfg.backend


def launcher_for(launch_cfg):
    """The ``Launcher`` ``launch_cfg`` picks."""
    return launcher_named(launcher_name(launch_cfg))


@functools.cache
def launcher_named(name: str):
    import importlib

    module, _, cls = LAUNCHERS[name].partition(":")
    return getattr(importlib.import_module(module), cls)(name)


def launchers_of_ranks(kinds: set[str]) -> list[str]:
    """The ``launch.backend`` names, sorted, of the launchers whose ranks are of one of ``kinds``."""
    return sorted(name for name in BACKENDS if launcher_named(name).ranks in kinds)


def needs_spark(launch_cfg) -> bool:
    """Whether the run's ranks are started on Spark (so the driver needs a session)."""
    return launcher_for(launch_cfg).spark


def coordinates_run(launch_cfg) -> bool:
    """Whether this process is the run's driver (the writer lock, the reader lease, the output
    checks, the summary): every process but the ranks other than 0 of a launcher outside Spark."""
    return launcher_for(launch_cfg).coordinates(launch_cfg)


def launch_run_id(launch_cfg) -> str | None:
    """The run id every process of one launch outside Spark shares, restarts included (the
    launcher's ``run_id``); None: the run id is the process's own."""
    return launcher_for(launch_cfg).run_id(launch_cfg)


def launch(plan, spark=None, on_step: Callable[[int], None] | None = None,
           on_restart: Callable[[int, str], None] | None = None,
           on_epoch: Callable[[dict], bool] | None = None) -> list[dict]:
    """Every rank's result (rank 0 first), or one typed error. ``plan.config.launch`` picks the
    launcher; ``spark`` is the job's session (unused in-process). ``on_step`` (in-process only) sees
    each step; ``on_restart(restart, reason)`` runs before each relaunch of the Spark ranks;
    ``on_epoch(record)``, on the driver, gets rank 0's record of each epoch and returns whether the
    run stops there (every launcher: in-process directly, Spark ranks through the supervisor)."""
    from training.launchers.rank_entry import check_results

    launcher = launcher_for(plan.config.launch)
    return check_results(launcher.launch(plan, spark, on_step=on_step, on_restart=on_restart, on_epoch=on_epoch))


def backend_for(launch_cfg, spark):
    """``launch_cfg`` with the backend this session runs: where ``launch.backend`` was left unset
    (horovod where installed) and the session is Spark Connect, which Horovod-on-Spark cannot run
    on, torch (unless ``launch.elastic``, which only Horovod offers: then exit 2 as for an explicit
    choice). Anything else unchanged."""
    import dataclasses

    from common.spark import is_connect

    if not (getattr(launch_cfg, "backend_auto", False) and launcher_named(launch_cfg.backend).classic_only
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

    why = launcher_named(backend).classic_only
    if why and spark is not None and is_connect(spark):
        from common.errors import ConfigError

        runs = ", ".join(name for name in BACKENDS
                         if launcher_named(name).spark and not launcher_named(name).classic_only)
        raise ConfigError(f"launch.backend={backend} cannot run on this Spark Connect session "
                          f"({why}, which Spark Connect does not offer): set launch.backend={runs}, "
                          "or run on a classic Spark session (a dedicated access mode cluster on Databricks)")


__all__ = ["BACKENDS", "IN_PROCESS", "LAUNCHERS", "backend_for", "check_backend_runs", "coordinates_run", "launch",
           "launch_run_id", "launcher_for", "launcher_name", "launcher_named", "launchers_of_ranks", "needs_spark"]
