"""What the examples' tests share: where the examples and this venv's commands are, and a bounded wait."""

from __future__ import annotations

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
# The project's own command, from the venv running the tests (what a user's crontab names).
SHARDTRAIN = os.path.join(os.path.dirname(sys.executable), "shardtrain")


def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    """Poll ``condition()`` until it is true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)
