"""The one fault-injection point of shardtrain, for tests that must kill or stop a process at a
moment they cannot reliably hit from outside (mid-swap of a commit, just after a rank's run).

``SHARDTRAIN_FAULT=<where>:<step>`` makes the process that reaches ``fault_point(where, step)``
kill itself (SIGKILL); ``<where>:<step>:stop`` makes it stop itself (SIGSTOP), so a test can
change the world and let it go on (SIGCONT). With ``SHARDTRAIN_FAULT_ONCE=<file>`` the fault
fires only while that file does not exist, and the process first writes its pid there: a
relaunched process passes the same point unharmed, and the test knows which pid it was.

The points (each named where it is called):
- ``commit:before-aside`` / ``commit:after-aside`` / ``commit:after-swap``: ``common.publish.commit``.
- ``table:before-swap`` / ``table:after-aside`` / ``table:after-swap``: ``common.tables.swap_in``.
- ``rank<N>:after-run``: rank N's run returned (model published, run report written), before its
  last report to the driver (``training.launchers.rank_entry``).
- ``rank<N>:step-<k>``: rank N starts training step k; passed only by a test's plug-in model
  (tests/training/plugin_models.py, ``stops_itself``), never by the product.
- ``sweep:after-trial``: a sweep's trial ended and its outcome is in the study, before the next
  trial is drawn (``shardtrain.sweep_runner``); without the once-file, each run of the sweep dies at its first.

Unset (as always outside tests), nothing happens. Nothing else in the product reads test hooks.
"""

from __future__ import annotations

import os
import signal

FAULT_ENV = "SHARDTRAIN_FAULT"
FAULT_ONCE_ENV = "SHARDTRAIN_FAULT_ONCE"


def fault_point(where: str, step: str) -> None:
    """Kill or stop this process here if ``SHARDTRAIN_FAULT`` names ``where:step`` (see above)."""
    flag = os.environ.get(FAULT_ENV, "").split(":")
    if flag[:2] != [where, step]:
        return
    once = os.environ.get(FAULT_ONCE_ENV)
    if once:
        if os.path.exists(once):
            return
        with open(once, "w") as fh:
            fh.write(str(os.getpid()))
    os.kill(os.getpid(), signal.SIGSTOP if flag[2:] == ["stop"] else signal.SIGKILL)


__all__ = ["FAULT_ENV", "FAULT_ONCE_ENV", "fault_point"]
