"""The one fault-injection point: a process that reaches the named point dies there by SIGKILL
(and with SHARDTRAIN_FAULT_ONCE, only the first process to get there), anywhere else nothing
happens. Real processes, checked by their exit signal."""

import os
import signal
import subprocess
import sys

import pytest

from common.faults import FAULT_ENV, FAULT_ONCE_ENV

pytestmark = pytest.mark.process  # the point is a real process killed at the named point

REACH = "from common.faults import fault_point\nfault_point('rank0', 'after-run')\nprint('passed')\n"


def _reach(env: dict) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, FAULT_ONCE_ENV)}
    return subprocess.run([sys.executable, "-c", REACH], env={**base, **env}, capture_output=True, text=True,
                          timeout=60)


def test_the_named_point_kills_the_process_and_other_points_do_nothing():
    assert _reach({FAULT_ENV: "rank0:after-run"}).returncode == -signal.SIGKILL
    for other in ("rank1:after-run", "commit:after-run", ""):
        proc = _reach({FAULT_ENV: other})
        assert proc.returncode == 0 and proc.stdout.strip() == "passed"


def test_once_kills_only_the_first_process_and_names_its_pid(tmp_path):
    once = tmp_path / "killed.pid"
    env = {FAULT_ENV: "rank0:after-run", FAULT_ONCE_ENV: str(once)}
    first = _reach(env)
    assert first.returncode == -signal.SIGKILL and int(once.read_text()) > 0
    again = _reach(env)  # a relaunched process passes the same point
    assert again.returncode == 0 and again.stdout.strip() == "passed"
