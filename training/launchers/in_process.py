"""World size 1 in the driver's own process: no Spark, no Horovod, no supervisor (debugging,
notebooks, GPU benchmarks). An exception of the run propagates as itself."""

from __future__ import annotations


def launch_in_process(plan, on_step=None) -> list[dict]:
    """The one rank's result, as a list like the Spark launchers'."""
    from training.loop import run_rank

    return [{"ok": True, **run_rank(plan, None, on_step=on_step)}]


__all__ = ["launch_in_process"]
