"""The failure policy: which failed launches are relaunched and which raised, rule by rule. Pure
logic on the typed errors and rank failure records a launch ends with; the same rules acting on
real launches are in test_supervisor.py (relaunch counts) and test_failures.py (real ranks)."""

import pytest

from common.errors import EXIT_USAGE, LaunchError, NonFiniteLossError, RankFailedError, RankFailure, RankStalledError
from training.launchers.failure_policy import RAISE, RETRY, FailurePolicy, is_secondary, is_transient
from training.launchers.rank_entry import failure_record


def _failure(type_, rank=1, exit_code=1, secondary=False):
    return RankFailure(rank=rank, type=type_, message="boom", traceback="", exit_code=exit_code, secondary=secondary)


@pytest.mark.parametrize("error, expected", [
    (LaunchError("rank 1 died", rank_lost=True), True),  # the launcher saw a process die
    (RankStalledError("rank 1 stalled"), True),
    (LaunchError("no task slots"), False),  # missing capacity fails the same way again
    (RankFailedError([_failure("HorovodInternalError", secondary=True)]), True),
    (RankFailedError([_failure("ConnectionResetError")]), True),
    (RankFailedError([_failure("OSError")]), True),  # storage went away
    (RankFailedError([_failure("DistNetworkError")]), True),
    (RankFailedError([_failure("ValueError")]), False),  # the rank's own bug fails again
    (RankFailedError([_failure("NonFiniteLossError")]), False),
    (RankFailedError([_failure("DatasetError", exit_code=EXIT_USAGE)]), False),
    # A transient type with a usage exit code is the user's mistake: not retried.
    (RankFailedError([_failure("OSError", exit_code=EXIT_USAGE)]), False),
    (NonFiniteLossError("nan"), False),
    (RuntimeError("not one of ours"), False),
])
def test_only_failures_a_relaunch_can_fix_are_transient(error, expected):
    assert is_transient(error) is expected


def test_the_cause_decides_not_the_ranks_that_failed_because_of_it():
    # Rank 0 failed only because rank 1 went away (secondary); rank 1's own ValueError is the
    # cause, so the launch is not retried, whatever the ranks' order.
    error = RankFailedError([_failure("HorovodInternalError", rank=0, secondary=True), _failure("ValueError", rank=1)])
    assert error.failures[0].type == "ValueError"
    assert not is_transient(error)
    # Only consequences reported (the cause died without a word): a relaunch can fix it.
    assert is_transient(RankFailedError([_failure("RuntimeError", rank=0, secondary=True)]))


@pytest.mark.parametrize("message, secondary", [
    ("HorovodInternalError: ring broken", True),
    ("Horovod has been shut down. This was caused by an exception on one of the ranks", True),
    ("Connection closed by peer [127.0.0.1]:1234", True),
    ("Gloo connectFullMesh failed ... timed out", True),
    ("Timed out waiting 30000ms for recv operation", True),
    ("[Errno 32] Broken pipe", True),
    ("Connection reset by peer", True),
    ("mat1 and mat2 shapes cannot be multiplied", False),
    ("column 'age' is missing", False),
])
def test_errors_that_only_say_another_rank_went_away_are_secondary(message, secondary):
    assert is_secondary("RuntimeError", message) is secondary
    # The record a rank sends carries the same judgement.
    assert failure_record(0, RuntimeError(message), "tb").secondary is secondary


def test_the_exception_type_alone_can_make_it_secondary():
    assert is_secondary("HorovodInternalError", "")
    assert failure_record(2, type("HorovodInternalError", (RuntimeError,), {})(), "tb").secondary
    # A connection error of the rank's own is not a consequence of another rank (the type name is
    # not the message): it is the cause, and transient by its type.
    record = failure_record(2, ConnectionResetError(), "tb")
    assert not record.secondary and is_transient(RankFailedError([record]))


DIED = LaunchError("rank 1 died", rank_lost=True)


@pytest.mark.parametrize("restarts, max_restarts, resume, action, announce, reason", [
    (0, 2, "auto", RETRY, False, "rank 1 died"),
    (1, 2, "auto", RETRY, False, "rank 1 died"),
    (2, 2, "auto", RAISE, True, "giving up after launch.max_restarts=2 restart(s)"),
    # No restarts configured: raised as it is, without a "giving up" line.
    (0, 0, "auto", RAISE, False, "giving up after launch.max_restarts=0 restart(s)"),
    # A relaunch would start over from step 0.
    (0, 2, "never", RAISE, True, "checkpoint.resume=never would start again from step 0"),
])
def test_a_transient_failure_is_retried_within_the_budget_and_only_when_resuming(restarts, max_restarts, resume,
                                                                                 action, announce, reason):
    decision = FailurePolicy(max_restarts, resume).decide(DIED, restarts)
    assert (decision.action, decision.announce) == (action, announce)
    assert reason in decision.reason


def test_a_failure_that_is_not_transient_is_raised_however_much_budget_is_left():
    decision = FailurePolicy(5, "auto").decide(RankFailedError([_failure("ValueError")]), 0)
    assert decision.action == RAISE and not decision.announce
    # Not retryable comes first: even with checkpoint.resume=never nothing is said about resuming.
    decision = FailurePolicy(5, "never").decide(LaunchError("no task slots"), 0)
    assert decision.action == RAISE and "resume" not in decision.reason


def test_the_retry_reason_is_the_errors_first_line():
    error = RankFailedError([_failure("ConnectionResetError")])
    decision = FailurePolicy(1).decide(error, 0)
    assert decision == (decision.__class__(RETRY, "training failed on rank 1: ConnectionResetError: boom"))


def _raised(rank: int, exc: BaseException):
    """``exc`` really raised on ``rank`` and recorded as a rank records it (its real traceback)."""
    import traceback

    try:
        raise exc
    except BaseException as raised:  # noqa: BLE001
        return failure_record(rank, raised, traceback.format_exc())


def test_an_input_error_found_on_the_ranks_is_one_line_and_a_bug_keeps_every_traceback():
    from common.errors import ConfigError

    why = "checkpoint /c/step-000000003 was written by a different run; set checkpoint.resume=never"
    same = RankFailedError([_raised(1, ConfigError(why)), _raised(0, ConfigError(why))])
    assert str(same) == f"training failed on rank 0 (rank(s) 1 too): ConfigError: {why}"
    assert same.exit_code == EXIT_USAGE
    bug = RankFailedError([_raised(1, ValueError("exploded")), _raised(0, ConnectionResetError("peer gone"))])
    assert str(bug).startswith("training failed on rank 0: ConnectionResetError: peer gone")
    assert "--- rank 0 traceback ---" in str(bug) and "--- rank 1 traceback ---" in str(bug)
    assert 'raise exc' in str(bug)  # the ranks' own tracebacks
