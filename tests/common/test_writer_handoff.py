"""``writer_lock.writing_under``: another process of a job writes under the writer lock its driver
holds (training's rank 0 publishing from an executor), and only while that holder lives."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from common.errors import OutputLockedError
from common.publish import publish
from common.writer_lock import lock_location, output_lock, writing_under

pytestmark = pytest.mark.process  # a holder process and a second writer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOLDER = ("import json, sys\nfrom common.writer_lock import output_lock\n"
          "with output_lock(sys.argv[1]) as record:\n    print(json.dumps(record), flush=True)\n    sys.stdin.read()\n")


@pytest.fixture
def holder(tmp_path):
    """A real process holding the writer lock of ``tmp_path/out``; yields (process, its record)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "out")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    record = json.loads(proc.stdout.readline())
    yield proc, record
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_a_process_publishes_under_the_lock_another_holds_and_a_stranger_is_still_refused(tmp_path, holder):
    proc, record = holder
    out = str(tmp_path / "out")
    with pytest.raises(OutputLockedError, match=f"is being written by pid {proc.pid}"):
        with output_lock(out):  # a writer of its own: refused, the lock is held
            pass
    with writing_under(out, record):
        with publish(out, marker={"kind": "shardtrain.model"}) as staging:
            staging.write_text("model.json", "{}")
    assert os.path.exists(os.path.join(out, "_COMMITTED"))
    assert proc.poll() is None and os.path.exists(lock_location(out).path)  # the holder's lock stays its own
    with pytest.raises(OutputLockedError, match=f"is being written by pid {proc.pid}.*no longer held"):
        with writing_under(out, {**record, "token": "another"}):  # another job's token: not this lock
            pass


def test_no_publish_under_the_lock_of_a_holder_that_died(tmp_path, holder):
    proc, record = holder
    out = str(tmp_path / "out")
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert json.load(open(lock_location(out).path))["token"] == record["token"]  # its record is still there
    with pytest.raises(OutputLockedError, match="is no longer held"):
        with writing_under(out, record):
            pass
    assert not os.path.exists(out)
