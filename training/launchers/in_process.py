"""World size 1 in the driver's own process: no Spark, no Horovod, no supervisor (debugging,
notebooks, GPU benchmarks). An exception of the run propagates as itself."""

from __future__ import annotations


def launch_in_process(plan, on_step=None, on_epoch=None) -> list[dict]:
    """The one rank's result, as a list like the Spark launchers'."""
    from training.distributed import LocalGroup, pick_device
    from training.loop import Hooks, run_rank

    group = LocalGroup(*pick_device(plan.config.launch, 0))
    return [{"ok": True, **run_rank(plan, group, hooks=Hooks(on_step, on_epoch))}]


__all__ = ["launch_in_process"]
