"""examples/cron/shardtrain-cron.sh as cron runs it: one run at a time, a log per run, the
command's exit status kept, an overlapping run skipped with its reason, no stale lock after a kill,
and a stop signal (TERM, INT, HUP) passed on to the command, which the wrapper waits for.
"""

from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import sys

import pytest

from common import __version__
from examples_env import EXAMPLES, SHARDTRAIN
from polling import wait_for

pytestmark = pytest.mark.process  # the wrapper's exit statuses, signals and lock, in real processes

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


def _as_cron_starts_it() -> None:
    """The stop signals at their defaults, as cron gives them: a test run started under ``nohup``
    (or as a background job) would otherwise hand the wrapper and its command an ignored SIGHUP
    (SIGINT), and the forwarded signal would end nothing."""
    for stop in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, signal.SIG_DFL)


class WrappedRun:
    """A run of the wrapper whose command holds until the test says; the command signals that it
    runs by creating ``started``. Its own session, so a failed test can stop the wrapper (and,
    through the log's "command pid" line, the command's own session) however far it got."""

    def __init__(self, log_dir, command: list[str], started):
        self.log_dir = log_dir
        self.proc = subprocess.Popen([WRAPPER, "--name", "nightly", "--log-dir", str(log_dir), "--", *command],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                                     preexec_fn=_as_cron_starts_it)
        wait_for(lambda: os.path.exists(started), "the run's command to start", timeout=60, proc=self.proc)
        assert self.proc.poll() is None, f"the run ended early: {self.proc.communicate()}"

    @property
    def log(self) -> str:
        return [p for p in logs(self.log_dir) if f"start nightly (pid {self.proc.pid})" in read(p)][0]

    @property
    def command_pid(self) -> int:
        pid = self._logged_command_pid()
        assert pid is not None, f"the wrapper's log names no command pid:\n{read(self.log)}"
        return pid

    def _logged_command_pid(self) -> int | None:
        found = [re.search(r"command pid (\d+)", read(p)) for p in logs(self.log_dir)
                 if f"start nightly (pid {self.proc.pid})" in read(p)]
        return int(found[0].group(1)) if found and found[0] else None

    def finish(self) -> subprocess.CompletedProcess:
        out, err = self.proc.communicate(timeout=60)
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out, err)

    def kill(self) -> None:
        """SIGKILL to whatever of the run is left: the wrapper's session and the command's."""
        command = self._logged_command_pid()
        sessions = [self.proc.pid] + ([command] if command is not None and running(command) else [])
        for session in sessions:
            try:
                os.killpg(session, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=60)


class BlockingRun(WrappedRun):
    """A first run whose command (one shell) holds until the test releases it through a FIFO."""

    def __init__(self, tmp_path, log_dir, exit_status: int = 0):
        started = tmp_path / "first-started"
        self.fifo = tmp_path / "release"
        os.mkfifo(self.fifo)
        script = f'echo started > "{started}"; read word < "{self.fifo}"; echo "released: $word"; exit {exit_status}'
        super().__init__(log_dir, ["sh", "-c", script], started)

    def release(self) -> subprocess.CompletedProcess:
        with open(self.fifo, "w") as f:
            f.write("go\n")
        return self.finish()


# A command with a child of its own (as shardtrain has its Spark JVM and ranks): it writes that
# child's pid, then waits for it. Neither handles a signal: each ends by the one it gets.
COMMAND_WITH_A_CHILD = """
import os, subprocess, sys
child = subprocess.Popen(["sleep", "300"])
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(child.pid))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
child.wait()
"""

# A command that handles TERM by cleaning up, which takes until the test releases it (a FIFO).
COMMAND_THAT_CLEANS_UP = """
import signal, sys

started, stopping, release = sys.argv[1:]
def stop(signum, frame):
    open(stopping, "w").close()
    with open(release) as f:
        f.read()
    print("cleaned up", flush=True)
    sys.exit(3)
signal.signal(signal.SIGTERM, stop)
open(started, "w").close()
while True:
    signal.pause()
"""


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, dead but not yet reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


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
    try:
        command = first.command_pid
        # SIGKILL cannot be forwarded: the wrapper dies, its command goes on and still holds the
        # lock, so the next run is skipped, naming the command that holds it.
        os.kill(first.proc.pid, signal.SIGKILL)
        assert first.proc.wait(timeout=60) == -signal.SIGKILL
        assert running(command)
        skipped = cron(log_dir, "true")
        assert skipped.returncode == SKIPPED and f"command pid {command})" in skipped.stderr, skipped

        os.killpg(command, signal.SIGKILL)
        wait_for(lambda: not running(command), "the killed command to be gone", timeout=60)
    finally:
        first.kill()

    # Nothing that held the lock is left: the lock is gone with it.
    again = cron(log_dir, "true")
    assert again.returncode == 0, again


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_a_stop_signal_ends_the_command_and_its_children_then_the_run(tmp_path, log_dir, stop):
    grandchild_file = tmp_path / "child.pid"
    run = WrappedRun(log_dir, [sys.executable, "-c", COMMAND_WITH_A_CHILD, str(grandchild_file)], grandchild_file)
    try:
        command, its_child = run.command_pid, int(grandchild_file.read_text())
        # The run is really under way: the command and its child run, and the run holds the lock.
        assert running(command) and running(its_child)
        assert cron(log_dir, "true").returncode == SKIPPED

        os.kill(run.proc.pid, stop)  # the wrapper alone, as `kill PID` or a terminal's Ctrl-C would
        done = run.finish()
    finally:
        run.kill()

    # The wrapper was not killed by the signal: it exited with its command's status, which the
    # signal ended (128+N), after the command was gone; the command's own child went too.
    assert done.returncode == 128 + stop, done
    assert not running(command)
    wait_for(lambda: not running(its_child), "the command's child to be gone", timeout=60)
    end = f"end nightly: exit status {128 + stop} after"
    assert end in read(run.log) and f"({stop.name} forwarded to the command)" in read(run.log), read(run.log)
    assert f"nightly exited with status {128 + stop} ({stop.name} forwarded to the command); log: " in done.stderr

    # The lock went with the run: the next one runs.
    assert cron(log_dir, "true").returncode == 0


def test_the_wrapper_waits_for_a_command_that_cleans_up_and_keeps_its_status(tmp_path, log_dir):
    started, stopping, release = tmp_path / "started", tmp_path / "stopping", tmp_path / "release"
    os.mkfifo(release)
    run = WrappedRun(log_dir, [sys.executable, "-c", COMMAND_THAT_CLEANS_UP, str(started), str(stopping),
                               str(release)], started)
    try:
        os.kill(run.proc.pid, signal.SIGTERM)
        wait_for(stopping.exists, "the command to start cleaning up", timeout=60)
        # Cleaning up: the wrapper waits for it, and still holds the lock.
        assert run.proc.poll() is None, "the wrapper ended before its command did"
        assert cron(log_dir, "true").returncode == SKIPPED
        with open(release, "w") as f:
            f.write("done\n")
        done = run.finish()
    finally:
        run.kill()

    assert done.returncode == 3, done  # the command's own status, not 143
    log = read(run.log)
    assert log.index("cleaned up") < log.index("end nightly: exit status 3 after"), log
    assert cron(log_dir, "true").returncode == 0


def test_usage_errors_are_not_a_shardtrain_status(log_dir):
    result = subprocess.run([WRAPPER, "--log-dir", str(log_dir)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 64
    assert "no command to run" in result.stderr
