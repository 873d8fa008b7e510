"""What a launcher is: ``Launcher``, the class of every entry of ``training.launchers.LAUNCHERS``,
with the defaults most of them keep, and ``SparkLauncher``, one whose ranks start as Spark tasks
under the driver's supervisor (``training.launchers.supervisor``).

A launcher declares what the driver reads before anything launches: the kind of rank group its
processes form (the strategies it offers are those that train on that kind,
``training.strategies``), whether it needs Spark (and classic Spark), whether it offers
``launch.elastic``, its own refusals of the ``launch`` section and how many of its ranks share a
host. ``launch`` then starts the ranks and returns each one's record. Like every launcher module,
this one imports nothing heavy: the supervisor and Spark's helpers are imported when a launch starts.
"""

from __future__ import annotations

from typing import Callable


class Launcher:
    """How the ranks of a run start. ``name``: its name in ``training.launchers.LAUNCHERS``."""

    ranks: str | None = "torch"  # the kind of rank group its processes form: torch.distributed's, Horovod's
    one_process = False  # its one process is the whole world: every technique trains as strategies.single
    spark = True  # its ranks start on Spark: the driver needs a session
    classic_only: str | None = None  # why it cannot run on Spark Connect, where it cannot
    elastic = False  # it offers launch.elastic (survivors go on at a smaller world size)
    # Why it cannot take code given to train() (training.user_code), where it cannot: None, it ships
    # the driver's pickled objects to its ranks with the plan.
    no_driver_code: str | None = None

    def __init__(self, name: str):
        self.name = name

    def check(self, launch_cfg) -> None:
        """Refuse (exit 2, naming the key) ``launch`` settings this launcher cannot run."""

    def ranks_on_this_host(self, launch_cfg) -> int:
        """How many of its ranks share this host's memory when they run here (local mode)."""
        return launch_cfg.num_proc

    def coordinates(self, launch_cfg) -> bool:
        """Whether this process is the run's driver (the writer lock, the reader lease, the output
        checks, the summary): every process but the ranks other than 0 of a launcher outside Spark."""
        return True

    def run_id(self, launch_cfg) -> str | None:
        """The run id every process of one launch shares, restarts included; None: each process's own."""
        return None

    def launch(self, plan, spark, on_step: Callable[[int], None] | None = None,
               on_restart: Callable[[int, str], None] | None = None,
               on_epoch: Callable[[dict], bool] | None = None) -> list[dict]:
        """Every rank's record (rank 0 first) of a run of ``plan`` (see ``training.launchers.launch``)."""
        raise NotImplementedError


class SparkLauncher(Launcher):
    """Ranks started as tasks of the job's Spark application, supervised from the driver (progress
    reports, the stall timeout, relaunches by the failure policy)."""

    def launch_ranks(self, plan, spark, launch_cfg) -> list[dict]:
        """One launch of ``launch_cfg.num_proc`` ranks: their records, or a typed error."""
        raise NotImplementedError

    def launch(self, plan, spark, on_step=None, on_restart=None, on_epoch=None) -> list[dict]:
        from common.spark import check_paths_reach_cluster
        from training.launchers import check_backend_runs
        from training.launchers.supervisor import run_supervised

        cfg = plan.config
        check_backend_runs(cfg.launch.backend, spark)
        check_paths_reach_cluster(cfg, spark)  # the ranks read and write through the cluster
        return run_supervised(self.launch_ranks, plan, spark, cfg.launch, cfg.checkpoint.resume,
                              on_restart=on_restart, on_epoch=on_epoch)


__all__ = ["Launcher", "SparkLauncher"]
