"""The supervisor's own logic without Spark: the stall rule, relaunching (the failure policy's
rules themselves: test_failure_policy.py), how a launch error reads, and ranks reporting over
real loopback sockets. The same pieces run on real Horovod ranks in test_failures.py."""

import json
import socket
import threading
import time

import pytest

from common.errors import EXIT_RUNTIME, LaunchError, RankFailedError, RankFailure
from polling import wait_for
from training.config import LaunchConfig
from training.launchers.failure_policy import is_transient
from training.launchers.horovod_spark import describe_exit, launch_error
from training.launchers.rank_entry import run_rank_entry
from training.launchers.progress import AFTER_PUBLISH, BETWEEN_EPOCHS, STARTING, TRAINING, VALIDATING, Reporter
from training.launchers.supervisor import RankState, Supervision, explain, find_stalled, run_supervised


def test_launch_keys_are_checked_naming_the_key():
    from common.errors import ConfigError

    with pytest.raises(ConfigError, match="stall_timeout_s"):
        LaunchConfig(stall_timeout_s=1)
    with pytest.raises(ConfigError, match="max_restarts"):
        LaunchConfig(max_restarts=-1)
    assert (LaunchConfig().stall_timeout_s, LaunchConfig().max_restarts) == (600, 2)
    assert LaunchConfig(num_proc=3, elastic=True, backend="horovod").min_num_proc == 2
    with pytest.raises(ConfigError, match="min_num_proc"):
        LaunchConfig(num_proc=2, elastic=True, backend="horovod", min_num_proc=3)
    with pytest.raises(ConfigError, match="elastic"):
        LaunchConfig(elastic=True, backend="torch")


def _state(rank, step, phase, seen, progress, **extra):
    return RankState(rank, step=step, phase=phase, last_seen=seen, last_progress=progress, **extra)


def test_stall_rule_counts_steps_inside_epochs_and_signs_of_life_outside():
    now, timeout = 1000.0, 60
    ranks = {
        0: _state(0, 40, TRAINING, seen=now - 1, progress=now - 61),      # alive, no step: stalled
        1: _state(1, 40, TRAINING, seen=now - 61, progress=now - 61),     # silent: stalled
        2: _state(2, 50, BETWEEN_EPOCHS, seen=now - 1, progress=now - 500),  # validating for long: fine
        3: _state(3, None, STARTING, seen=now - 1, progress=now - 500),   # slow start-up: fine
        4: _state(4, 50, TRAINING, seen=now - 70, progress=now - 70, done=True),  # finished: fine
        5: _state(5, 12, TRAINING, seen=now - 30, progress=now - 30, lost_at=now - 30),  # died recently
        7: _state(7, 50, VALIDATING, seen=now - 1, progress=now - 61, batches=3),  # alive, no batch: stalled
        8: _state(8, 50, VALIDATING, seen=now - 1, progress=now - 59, batches=9),  # validating, moving: fine
    }
    stalled = dict(find_stalled(ranks, world=9, started=now - 100, now=now, timeout=timeout))
    assert sorted(stalled) == [0, 1, 6, 7]
    assert "alive but made no progress in validation" in stalled[7] and "after 3 validation batch" in stalled[7]
    assert "alive but made no step" in stalled[0] and "at step 40" in stalled[0]
    assert "sent nothing for 61 s" in stalled[1]
    assert "never reported" in stalled[6]
    ranks[5].lost_at = now - 61
    # launch.elastic: the others go on without a dead rank, so it is never a stall.
    assert 5 not in dict(find_stalled(ranks, world=9, started=now - 100, now=now, timeout=timeout, elastic=True))
    assert 5 in dict(find_stalled(ranks, world=9, started=now - 100, now=now, timeout=timeout))
    assert find_stalled({}, world=2, started=now - 10, now=now, timeout=timeout) == []
    # After the publish (the run report, MLflow tracking) a live rank has no steps, but a bound.
    after = {0: _state(0, 50, AFTER_PUBLISH, seen=now - 1, progress=now - 59)}
    assert find_stalled(after, world=1, started=now - 100, now=now, timeout=timeout) == []
    after[0].last_progress = now - 61
    (why,) = dict(find_stalled(after, world=1, started=now - 100, now=now, timeout=timeout)).values()
    assert "rank 0 published the model 61 s ago and has not finished" in why
    # A live rank waiting since just before its peer went silent: the verdict waits for the silent
    # peer (at most half the timeout), which is then named with it, the cause first.
    waiting = {0: _state(0, 40, VALIDATING, seen=now - 1, progress=now - 61, batches=5),
               1: _state(1, 40, VALIDATING, seen=now - 45, progress=now - 45, batches=1)}
    assert find_stalled(waiting, world=2, started=now - 100, now=now, timeout=timeout) == []
    waiting[1].last_seen = now - 61
    assert sorted(dict(find_stalled(waiting, world=2, started=now - 100, now=now, timeout=timeout))) == [0, 1]
    waiting[1].last_seen = now - 29  # a peer that beats: the waiter alone is named, as before
    assert [r for r, _ in find_stalled(waiting, world=2, started=now - 100, now=now, timeout=timeout)] == [0]
    # Not reported yet, but the launcher may still be waiting for task slots.
    assert find_stalled({}, world=1, started=now - 100, now=now, timeout=timeout, start_timeout=120) == []
    # Never reported while Spark runs the launch's tasks: it cannot reach the driver, it is not stalled
    # (a rank that did report is still held to its reports).
    assert [r for r, _ in find_stalled({}, world=2, started=now - 1000, now=now, timeout=timeout)] == [0, 1]
    silent = {1: _state(1, 7, TRAINING, seen=now - 100, progress=now - 100)}
    assert [r for r, _ in find_stalled(silent, world=2, started=now - 1000, now=now, timeout=timeout,
                                       tasks_running=True)] == [1]


def _failure(type_, exit_code=1, secondary=False):
    return RankFailure(rank=1, type=type_, message="boom", traceback="", exit_code=exit_code, secondary=secondary)


def test_a_dead_process_is_named_by_rank_and_signal_and_capacity_advice_is_for_timeouts_only():
    died = RuntimeError("Horovod detected that one or more processes exited with non-zero status, thus causing the "
                        "job to be terminated. The first process to do so was:\nProcess name: 1\nExit code: 137\n")
    error = launch_error(died, 2)
    assert str(error).startswith("training failed on rank 1: its process exited with status 137: killed by SIGKILL")
    assert "task slot" not in str(error) and error.rank_lost
    assert error.exit_code == EXIT_RUNTIME  # what the job exits with once no restart is left
    timeout = Exception("Timed out waiting for Spark tasks to start. Please check that you have enough resources")
    error = launch_error(timeout, 2)
    assert "task slot" in str(error) and not error.rank_lost
    assert describe_exit(-15) == "status -15: killed by SIGTERM"
    assert describe_exit(1) == "status 1"


def test_a_rank_that_died_makes_any_launch_error_name_its_step_and_retryable():
    """Whatever a backend raised (here a barrier stage failure), the ranks' reports say who died where."""
    ranks = {0: _state(0, 31, TRAINING, 0, 0, done=True, error="RuntimeError: peer closed", secondary=True),
             1: _state(1, 30, TRAINING, 0, 0, lost_at=5.0)}
    error = explain(LaunchError("TorchDistributor could not run 2 rank(s): barrier stage failed"), ranks)
    assert "rank 1 died at step 30 without reporting an error" in str(error)
    assert "peer closed" not in str(error)  # a consequence, not the cause
    assert is_transient(error)


def test_ranks_report_steps_errors_and_death_over_loopback():
    with Supervision(None, world=3, stall_timeout_s=60) as sup:
        env = sup.launch_env()
        address, token = env["SHARDTRAIN_SUPERVISOR"], env["SHARDTRAIN_SUPERVISOR_TOKEN"]
        ok = Reporter(address, token, rank=0, steps_per_epoch=10, interval=0.05)
        failed = Reporter(address, token, rank=1, steps_per_epoch=10, interval=0.05)
        ok.on_step(7)
        failed.on_step(10)
        wait_for(lambda: sup.ranks().get(0) and sup.ranks()[0].step == 7, "rank 0's step 7", timeout=30)
        wait_for(lambda: sup.ranks().get(1) and sup.ranks()[1].phase == BETWEEN_EPOCHS, "rank 1 between epochs",
                 timeout=30)
        failed.finished("OSError: disk full")
        ok.finished(None)
        # A rank whose process dies: its connection drops without a final report.
        dying = socket.create_connection(tuple(address.rsplit(":", 1)[0:1]) + (int(address.rsplit(":", 1)[1]),))
        dying.sendall((json.dumps({"event": "hello", "token": token, "rank": 2, "step": 3, "phase": TRAINING}) + "\n")
                      .encode())
        wait_for(lambda: 2 in sup.ranks(), "rank 2's hello", timeout=30)
        dying.close()
        wait_for(lambda: sup.ranks()[2].lost_at is not None, "rank 2 to be lost", timeout=30)
        # A connection without the launch's token is not a rank of this launch.
        stranger = socket.create_connection((address.rsplit(":", 1)[0], int(address.rsplit(":", 1)[1])))
        stranger.sendall(b'{"event": "hello", "token": "wrong", "rank": 5}\n')
        ranks = sup.ranks()
        assert ranks[0].done and ranks[0].error is None and ranks[0].pid is not None
        assert ranks[1].done and ranks[1].error == "OSError: disk full"
        assert 5 not in ranks and sup.stall is None
        stranger.close()


def test_an_elastic_rank_lost_just_before_the_launch_ends_is_still_said_once(caplog):
    """launch.elastic: the watcher says "rank N left" at its next beat (up to 1 s later); a launch that
    ends first (the loss near the end of the run, or late on a loaded machine) says it on leaving,
    and a loss the watcher already said is not said twice. Without the exit's check the block below
    ends within milliseconds of the loss, before the watcher's next beat, and nothing is said."""
    with caplog.at_level("WARNING", logger="shardtrain"):
        with Supervision(None, world=2, stall_timeout_s=600, elastic=True) as sup:
            ranks = _hello_ranks(sup, step=3, phase=TRAINING)
            wait_for(lambda: sorted(sup.ranks()) == [0, 1], "both ranks' hello", timeout=30)
            ranks[1].close()  # rank 1's process died: its connection drops without a final report
            wait_for(lambda: sup.ranks()[1].lost_at is not None, "rank 1 to be lost", timeout=30)
        ranks[0].close()
        said = [r.getMessage() for r in caplog.records if "left: its process died" in r.getMessage()]
    assert said == ["rank 1 left: its process died at step 3 without reporting an error; launch.elastic: the 1 "
                    "other rank(s) go on without it at world size 1"], said


def test_leaving_a_supervision_does_not_wait_out_the_progress_servers_poll(monkeypatch):
    """socketserver's shutdown() returns at the serve loop's next poll (0.5 s by default, paid by every
    launch); leaving a supervision wakes the loop instead. With an hour-long poll it still returns:
    the old exit hung here for the hour (the wait below only bounds that hang)."""
    import functools
    import socketserver

    from training.launchers.supervisor import ProgressServer

    monkeypatch.setattr(ProgressServer, "serve_forever",
                        functools.partialmethod(socketserver.BaseServer.serve_forever, poll_interval=3600))
    left = threading.Event()

    def enter_and_leave():
        with Supervision(None, world=2, stall_timeout_s=60) as sup:
            ranks = _hello_ranks(sup, step=None, phase=STARTING)
            # Served: the loop runs, and is back in its hour-long select when the block ends.
            wait_for(lambda: sorted(sup.ranks()) == [0, 1], "both ranks' hello", timeout=30)
            for conn in ranks:
                conn.close()
        left.set()

    threading.Thread(target=enter_and_leave, daemon=True).start()
    assert left.wait(timeout=120), "leaving the supervision waited for the server's hour-long poll"


def test_the_reporter_says_validating_until_the_pass_ends():
    reporter = Reporter(None, "", rank=0, steps_per_epoch=10, interval=1)
    reporter.on_step(10)
    assert reporter.phase == BETWEEN_EPOCHS
    reporter.on_validation(0)
    assert reporter.phase == VALIDATING
    reporter.on_validation(None)  # the pass is over: checkpoint writes and the publish count beats only
    assert reporter.phase == BETWEEN_EPOCHS
    reporter.on_published()
    assert reporter.phase == AFTER_PUBLISH


def _hello_ranks(sup, **state) -> list:
    """Ranks 0 and 1 as raw sockets that said hello with ``state`` (an in-process Reporter would
    exit this process on "abort")."""
    env = sup.launch_env()
    host, port = env["SHARDTRAIN_SUPERVISOR"].rsplit(":", 1)
    ranks = []
    for rank in (0, 1):
        conn = socket.create_connection((host, int(port)))
        conn.sendall((json.dumps({"event": "hello", "token": env["SHARDTRAIN_SUPERVISOR_TOKEN"], "rank": rank,
                                  **state}) + "\n").encode())
        ranks.append(conn)
    return ranks


def test_a_rank_alive_but_stuck_in_validation_is_named():
    """Both ranks beat (their processes live); rank 0's validation batches advance, rank 1's do not."""
    with Supervision(None, world=2, stall_timeout_s=2) as sup:
        ranks = _hello_ranks(sup, step=10, phase=VALIDATING, batches=0)
        stop = threading.Event()

        def beat():
            batches = 0
            while not stop.wait(0.1):
                batches += 1
                for rank, done in ((0, batches), (1, 2)):
                    ranks[rank].sendall((json.dumps({"event": "beat", "rank": rank, "step": 10, "phase": VALIDATING,
                                                     "batches": done}) + "\n").encode())
        threading.Thread(target=beat, daemon=True).start()
        wait_for(lambda: sup.stall is not None, "the supervisor to find a stall", timeout=30)
        stop.set()
        assert sup.stall.startswith("rank 1 stalled"), sup.stall
        assert "rank 1 is alive but made no progress in validation" in sup.stall and "after 2 validation" in sup.stall
        assert "rank 0 is alive" not in sup.stall
        for conn in ranks:
            conn.close()


def test_a_silent_rank_is_named_and_live_ranks_are_told_to_abort():
    with Supervision(None, world=2, stall_timeout_s=2) as sup:
        ranks = _hello_ranks(sup, step=4, phase=TRAINING)
        stop = threading.Event()

        def keep_rank_0_training():
            # Rank 0 makes steps: a rank that only beats inside an epoch is stalled too, and which
            # of the two the watcher names first would then be a race.
            step = 4
            while not stop.wait(0.1):
                step += 1
                ranks[0].sendall((json.dumps({"event": "beat", "rank": 0, "step": step, "phase": TRAINING}) + "\n")
                                 .encode())
        threading.Thread(target=keep_rank_0_training, daemon=True).start()
        wait_for(lambda: sup.stall is not None, "the supervisor to find a stall", timeout=30)
        stop.set()
        assert sup.stall.startswith("rank 1 stalled"), sup.stall
        assert "rank 1 sent nothing" in sup.stall and "at step 4" in sup.stall
        ranks[0].settimeout(10)
        assert ranks[0].makefile("r").readline().strip() == "abort"
        for conn in ranks:
            conn.close()


def _launch_failing(times, error):
    calls = []

    def launch_fn(plan, spark, launch_cfg):
        calls.append(launch_cfg.env)
        if len(calls) <= times:
            raise error
        return [{"ok": True, "resumed_from": "ckpt/step-000000020", "resumed_step": 20}]
    return launch_fn, calls


class _Plan:
    world_size = 0  # no rank reports in these tests: nothing can stall
    pipeline_stages = 1


@pytest.mark.parametrize("failures, max_restarts, resume, launches, succeeds", [
    (1, 2, "auto", 2, True),
    (2, 2, "auto", 3, True),
    (3, 2, "auto", 3, False),
    (1, 0, "auto", 1, False),
    (1, 2, "never", 1, False),  # a relaunch would start over from step 0
])
def test_relaunches_up_to_max_restarts(failures, max_restarts, resume, launches, succeeds):
    launch_fn, calls = _launch_failing(failures, LaunchError("rank 1 died", rank_lost=True))
    cfg = LaunchConfig(max_restarts=max_restarts)
    if succeeds:
        assert run_supervised(launch_fn, _Plan(), None, cfg, resume)[0]["resumed_step"] == 20
    else:
        with pytest.raises(LaunchError):
            run_supervised(launch_fn, _Plan(), None, cfg, resume)
    assert len(calls) == launches
    assert len({c["SHARDTRAIN_SUPERVISOR_TOKEN"] for c in calls}) == launches  # each launch its own token


def test_a_rank_bug_is_not_relaunched():
    launch_fn, calls = _launch_failing(1, RankFailedError([_failure("ValueError")]))
    with pytest.raises(RankFailedError):
        run_supervised(launch_fn, _Plan(), None, LaunchConfig(), "auto")
    assert len(calls) == 1


@pytest.mark.process
def test_a_live_rank_process_exits_when_the_driver_aborts_the_launch():
    """A real Reporter in its own process: it keeps reporting, another rank goes silent, and the
    driver's abort makes the live one exit with status 1 instead of waiting for the silent one."""
    import subprocess
    import sys

    # 3 s: rank 0 reports every 0.1 s, so only rank 1's silence can last that long, even when a
    # loaded machine delays rank 0's reports by a second (at 1 s it was once itself judged silent).
    with Supervision(None, world=2, stall_timeout_s=3) as sup:
        env = sup.launch_env()
        host, port = env["SHARDTRAIN_SUPERVISOR"].rsplit(":", 1)
        # The rank says it runs on another host: the driver then cannot SIGKILL it (it does that to
        # rank processes on its own host, which raced the abort line), so only the abort can stop it.
        rank_0 = subprocess.Popen([sys.executable, "-c", (
            "import socket, sys, threading\n"
            "socket.gethostname = lambda: 'another-host'\n"
            "from training.launchers.progress import Reporter\n"
            "Reporter(sys.argv[1], sys.argv[2], rank=0, steps_per_epoch=10, interval=0.1)\n"
            "threading.Event().wait(120)\n"), env["SHARDTRAIN_SUPERVISOR"], env["SHARDTRAIN_SUPERVISOR_TOKEN"]])
        # Rank 1 goes silent only once rank 0 is connected: a slow interpreter start on a loaded
        # machine must not let the stall (and the abort) happen before rank 0 can hear it.
        wait_for(lambda: 0 in sup.ranks(), "rank 0's reporter to connect", timeout=60, proc=rank_0)
        silent = socket.create_connection((host, int(port)))
        silent.sendall((json.dumps({"event": "hello", "token": env["SHARDTRAIN_SUPERVISOR_TOKEN"], "rank": 1,
                                    "step": None, "phase": STARTING}) + "\n").encode())
        try:
            assert rank_0.wait(timeout=60) == 1
        finally:
            rank_0.kill()
            silent.close()
        assert sup.stall.startswith("rank 1 stalled") and "rank 0 before its first step" in sup.stall


@pytest.mark.process
def test_a_rank_stuck_after_publishing_is_stopped_while_one_between_epochs_is_not():
    """A real Reporter in its own process, alive (beating) all along: between epochs it may take
    longer than the timeout (a checkpoint write); once it reports the publish, what is left (report,
    MLflow) is bounded, and hanging there makes the driver stop it (exit 1 on abort)."""
    import subprocess
    import sys

    with Supervision(None, world=2, stall_timeout_s=3) as sup:
        env = sup.launch_env()
        host, port = env["SHARDTRAIN_SUPERVISOR"].rsplit(":", 1)
        rank_0 = subprocess.Popen([sys.executable, "-c", (
            "import socket, sys, threading\n"
            "socket.gethostname = lambda: 'another-host'\n"  # only the abort line can stop it (see above)
            "from training.launchers.progress import Reporter\n"
            "reporter = Reporter(sys.argv[1], sys.argv[2], rank=0, steps_per_epoch=10, interval=0.1)\n"
            "reporter.on_step(10)\n"
            "sys.stdin.readline()\n"
            "reporter.on_published()\n"
            "threading.Event().wait(120)\n"),  # hangs after the publish, as in a silent MLflow call
            env["SHARDTRAIN_SUPERVISOR"], env["SHARDTRAIN_SUPERVISOR_TOKEN"]], stdin=subprocess.PIPE, text=True)
        finished = socket.create_connection((host, int(port)))
        try:
            finished.sendall((json.dumps({"event": "hello", "token": env["SHARDTRAIN_SUPERVISOR_TOKEN"], "rank": 1,
                                          "step": 10, "phase": BETWEEN_EPOCHS}) + "\n"
                              + json.dumps({"event": "done", "rank": 1, "step": 10, "error": None}) + "\n").encode())
            wait_for(lambda: sup.ranks().get(0) and sup.ranks()[0].phase == BETWEEN_EPOCHS, "rank 0 between epochs",
                     timeout=60)
            time.sleep(4)  # more than the timeout between epochs, beating: not a stall
            assert sup.stall is None and rank_0.poll() is None
            rank_0.stdin.write("published\n")
            rank_0.stdin.flush()
            assert rank_0.wait(timeout=60) == 1  # told to abort by the driver
        finally:
            rank_0.kill()
            finished.close()
        assert sup.stall.startswith("rank 0 stalled"), sup.stall
        assert "rank 0 published the model" in sup.stall and "MLflow tracking" in sup.stall


class _Group:
    rank = 1

    def __init__(self):
        self.stopped = 0


class _RankPlan:
    steps_per_epoch = 10


def test_the_rank_entry_reports_a_failure_with_its_traceback_then_stops_the_group(monkeypatch):
    """The one rank-entry sequence of every launcher: the rank's own exception comes back as a
    record (never raised), its last report reaches the driver, and the group is stopped after."""
    group = _Group()

    def train(plan, group, reporter):
        reporter.on_step(3)
        raise ValueError("mat1 and mat2 shapes cannot be multiplied")

    def stop(g):
        # Reported before the stop.
        wait_for(lambda: sup.ranks().get(1) and sup.ranks()[1].done, "rank 1's final report", timeout=30)
        g.stopped += 1

    with Supervision(None, world=2, stall_timeout_s=60) as sup:
        for key, value in sup.launch_env().items():
            monkeypatch.setenv(key, value)
        result = run_rank_entry(_RankPlan(), 1, lambda plan: group, train, stop_group=stop)
        assert result["ok"] is False and group.stopped == 1
        failure = RankFailure(**result["failure"])
        assert (failure.rank, failure.type, failure.secondary) == (1, "ValueError", False)
        assert "in train" in failure.traceback and "mat1 and mat2" in failure.traceback
        state = sup.ranks()[1]
        assert state.step == 3 and state.error == "ValueError: mat1 and mat2 shapes cannot be multiplied"
        # A rank that succeeds reports done without an error.
        ok = run_rank_entry(_RankPlan(), 1, lambda plan: _Group(), lambda plan, g, r: {"published": True})
        assert ok == {"ok": True, "published": True}


def test_rank_0_asks_the_driver_at_each_epoch_end_and_gets_its_answer_over_loopback():
    """train(on_epoch=...) on Spark ranks: rank 0 sends each epoch's record, the driver's callback
    answers stop or go; a driver without a callback sets no flag, and its ranks never ask."""
    seen = []

    def on_epoch(record):
        seen.append(record)
        if record["epoch"] == 3:
            raise RuntimeError("a pruner's bug")  # warns; the run goes on
        return record["epoch"] >= 2

    with Supervision(None, world=1, stall_timeout_s=60, on_epoch=on_epoch) as sup:
        env = sup.launch_env()
        assert env["SHARDTRAIN_SUPERVISOR_EPOCHS"] == "1"
        rank0 = Reporter(env["SHARDTRAIN_SUPERVISOR"], env["SHARDTRAIN_SUPERVISOR_TOKEN"], rank=0, steps_per_epoch=10,
                         interval=0.05, asks_epochs=True)
        answers = [rank0.should_stop({"epoch": e, "val_accuracy": 0.5}) for e in (1, 2, 3)]
        rank0.finished(None)
    assert answers == [False, True, False]
    assert [r["epoch"] for r in seen] == [1, 2, 3] and seen[0]["val_accuracy"] == 0.5
    with Supervision(None, world=1, stall_timeout_s=60) as sup:
        assert "SHARDTRAIN_SUPERVISOR_EPOCHS" not in sup.launch_env()
