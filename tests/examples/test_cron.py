"""examples/cron/shardtrain-cron.sh as cron runs it: one run at a time, a log per run, the
command's exit status kept, an overlapping run skipped with its reason, no stale lock after a kill.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess

import pytest

from common import __version__
from examples_env import EXAMPLES, SHARDTRAIN, wait_for

WRAPPER = os.path.join(EXAMPLES, "cron", "shardtrain-cron.sh")
SKIPPED = 75


def cron(log_dir, *command, name="nightly"):
    return subprocess.run([WRAPPER, "--name", name, "--log-dir", str(log_dir), "--", *command],
                          capture_output=True, text=True, timeout=300)


def logs(log_dir, name="nightly") -> list[str]:
    return sorted(glob.glob(os.path.join(str(log_dir), f"{name}-*.log")), key=os.path.getmtime)


def read(path) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


class BlockingRun:
    """A first run whose command holds until the test releases it through a FIFO."""

    def __init__(self, tmp_path, log_dir, exit_status: int = 0):
        self.started = tmp_path / "first-started"
        self.fifo = tmp_path / "release"
        os.mkfifo(self.fifo)
        script = f'echo started > "{self.started}"; read word < "{self.fifo}"; echo "released: $word"; exit {exit_status}'
        # Its own session, so a failed test can stop the wrapper and its command together.
        self.proc = subprocess.Popen([WRAPPER, "--name", "nightly", "--log-dir", str(log_dir), "--", "sh", "-c", script],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        wait_for(lambda: self.started.exists() or self.proc.poll() is not None, "the first run's command to start")
        assert self.proc.poll() is None, f"the first run ended early: {self.proc.communicate()}"

    def release(self) -> subprocess.CompletedProcess:
        with open(self.fifo, "w") as f:
            f.write("go\n")
        out, err = self.proc.communicate(timeout=60)
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out, err)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=60)


@pytest.fixture
def log_dir(tmp_path):
    return tmp_path / "logs"


def test_an_overlapping_run_is_skipped_and_says_why(tmp_path, log_dir):
    first = BlockingRun(tmp_path, log_dir)
    try:
        second_ran = tmp_path / "second-ran"
        second = cron(log_dir, "touch", str(second_ran))

        assert second.returncode == SKIPPED, second
        assert not second_ran.exists(), "the overlapping run ran its command"
        assert "skipped" in second.stderr and "still holds the lock" in second.stderr, second.stderr
        assert f"pid {first.proc.pid} " in second.stderr, "the message should name the run holding the lock"
        skipped_log = [p for p in logs(log_dir) if "skipped" in read(p)]
        assert len(skipped_log) == 1 and "this run did nothing" in read(skipped_log[0])

        done = first.release()
    finally:
        first.kill()
    assert done.returncode == 0, done
    assert done.stderr == "", "a successful run writes nothing for cron to mail"
    first_log = read([p for p in logs(log_dir) if "released: go" in read(p)][0])
    assert "start nightly" in first_log and "end nightly: exit status 0" in first_log

    # The lock went with the first run: the next one runs.
    third = cron(log_dir, "touch", str(second_ran))
    assert third.returncode == 0, third
    assert second_ran.exists()


def test_the_commands_exit_status_is_kept(tmp_path, log_dir):
    first = BlockingRun(tmp_path, log_dir, exit_status=1)
    try:
        done = first.release()
    finally:
        first.kill()
    assert done.returncode == 1
    assert "nightly exited with status 1; log: " in done.stderr


def test_a_real_shardtrain_command_runs_and_its_status_2_passes_through(tmp_path, log_dir):
    ok = cron(log_dir, SHARDTRAIN, "--version")
    assert ok.returncode == 0, ok
    assert f"shardtrain {__version__}" in read(logs(log_dir)[-1])

    # A config error: shardtrain says "fix the input" (2), and cron sees 2 with the log's path.
    bad = tmp_path / "shard.yaml"
    bad.write_text("sources: {raw: {path: raw}}\nlabel: {column: label, num_classes: 2}\n"
                   "split: {key: id}\noutput: {path: out, num_shard: 4}\n")
    failed = cron(log_dir, SHARDTRAIN, "shard", "--config", str(bad))
    assert failed.returncode == 2, failed
    log = logs(log_dir)[-1]
    assert f"log: {log}" in failed.stderr
    assert "unknown key 'output.num_shard'; did you mean 'output.num_shards'?" in read(log)
    assert "end nightly: exit status 2" in read(log)


def test_a_killed_run_leaves_no_stale_lock(tmp_path, log_dir):
    first = BlockingRun(tmp_path, log_dir)
    first.kill()
    assert first.proc.returncode == -signal.SIGKILL
    wait_for(lambda: _gone(first.proc.pid), "the killed run's processes to be gone")

    again = cron(log_dir, "true")
    assert again.returncode == 0, again


def test_usage_errors_are_not_a_shardtrain_status(log_dir):
    result = subprocess.run([WRAPPER, "--log-dir", str(log_dir)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 64
    assert "no command to run" in result.stderr


def _gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False
