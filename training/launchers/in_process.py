"""World size 1 in the driver's own process (``launch.mode=in_process``): no Spark, no Horovod,
no supervisor (debugging, notebooks, GPU benchmarks). An exception of the run propagates as itself."""

from __future__ import annotations

from common.config import require
from training.launchers.base import Launcher


class InProcessLauncher(Launcher):
    """The one rank, in this process, on the device ``launch.device`` asks for."""

    ranks = None
    one_process = True
    spark = False

    def check(self, launch_cfg) -> None:
        require(launch_cfg.num_proc == 1, "num_proc",
                f"must be 1 with launch.mode=in_process (got {launch_cfg.num_proc})")

    def ranks_on_this_host(self, launch_cfg) -> int:
        return 1

    def launch(self, plan, spark, on_step=None, on_restart=None, on_epoch=None) -> list[dict]:
        """The one rank's result, as a list like the Spark launchers'."""
        from training.distributed import LocalGroup, in_process_device
        from training.loop import Hooks, run_rank

        group = LocalGroup(*in_process_device(plan.config.launch))
        return [{"ok": True, **run_rank(plan, group, hooks=Hooks(on_step, on_epoch))}]


__all__ = ["InProcessLauncher"]
