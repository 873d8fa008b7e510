"""The suite's one bounded wait: poll a condition until it holds, and fail naming what was awaited.

Every test directory can import it by name (tests/conftest.py puts tests/ on sys.path). A test
waits on what it can observe (a file, a pid's state, a rank's report), never on time alone; the
timeout only turns a hang into a failure that says what never happened.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")

OUTPUT_TAIL = 3000  # characters of a process's output quoted in a failure


def wait_for(condition: Callable[[], T], what: str, timeout: float, *, proc: subprocess.Popen | None = None,
             log: str | Path | None = None, abort: threading.Event | None = None, interval: float = 0.05) -> T:
    """Call ``condition()`` every ``interval`` seconds until it returns something truthy, and
    return that value (a found pid, a marker file, ``True``).

    It fails with ``AssertionError`` naming ``what``:
    - after ``timeout`` seconds (with the tail of ``log``, when given);
    - when ``proc``, the process the test waits on, exits first: its exit status and the tail of
      its output (``log``, the file it writes to, or else its stdout/stderr pipes) are in the message;
    - at once when ``abort`` is set (e.g. by the test when the job it watches from a thread has ended).

    ``AssertionError`` is an ``Exception`` (``pytest.fail`` raises a ``BaseException``), so a
    watcher thread can catch it and hand it to the test.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            value = condition()  # it may have come true just before the process ended
            if value:
                return value
            raise AssertionError(f"{_name(proc)} (pid {proc.pid}) exited with status {proc.returncode} "
                                 f"while waiting for {what}{_output_tail(proc, log)}")
        if abort is not None and abort.is_set():
            raise AssertionError(f"the job ended before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}{_log_tail(log)}")
        time.sleep(interval)


def _name(proc: subprocess.Popen) -> str:
    args = proc.args
    first = args[0] if isinstance(args, (list, tuple)) and args else args
    return os.path.basename(str(first))


def _log_tail(log: str | Path | None) -> str:
    if log is None or not os.path.exists(log):
        return ""
    return ":\n" + Path(log).read_text(errors="replace")[-OUTPUT_TAIL:]


def _output_tail(proc: subprocess.Popen, log: str | Path | None) -> str:
    if log is not None:
        return _log_tail(log)
    if proc.stdout is None and proc.stderr is None:
        return ""  # its output went to the test's own stdout/stderr (or nowhere)
    out, err = proc.communicate(timeout=30)
    text = "".join(part.decode(errors="replace") if isinstance(part, bytes) else part for part in (out, err) if part)
    return ":\n" + text[-OUTPUT_TAIL:]
