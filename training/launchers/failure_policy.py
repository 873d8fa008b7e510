"""Whether a failed launch is relaunched or its error raised: every rule in one place, pure.

A failure a relaunch can fix is a rank's process that died or stalled, or a connection (to another
rank, to storage) that broke; a rank's own exception (a bug in a model, bad data, a usage error)
would fail the same way again, and so would missing capacity. The inputs are the typed errors the
launch ends with and the failure records they carry (``common.errors.RankFailure``): what a rank
raised, and whether that only says another rank went away (``secondary``, set from the rank's
message by ``is_secondary`` when the record is made). ``LaunchError.rank_lost`` is the launcher's
word on what it saw (a process died: yes; no task slots: no); the rule that makes it retryable is here.

Then the budget: at most ``launch.max_restarts`` relaunches, and only with ``checkpoint.resume=auto``
(any other value would start the ranks again from step 0).

Nothing here touches a process, a socket or Spark: ``FailurePolicy(...).decide(error, restarts)``
returns a ``Decision`` and the supervisor (``training.launchers.supervisor``) acts on it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from common.errors import EXIT_RUNTIME, LaunchError, RankFailedError, RankStalledError, first_line

RETRY, RAISE = "retry", "raise"

# Exception types of a rank that say "the connection to another rank or to storage broke".
TRANSIENT_TYPES = frozenset({"HorovodInternalError", "ConnectionError", "ConnectionResetError",
                             "ConnectionAbortedError", "BrokenPipeError", "TimeoutError", "OSError",
                             "DistBackendError", "DistNetworkError"})
# Messages a rank raises because *another* rank went away: consequences, not causes.
_SECONDARY = re.compile(r"HorovodInternalError|Horovod has been shut down|Connection closed by peer|"
                        r"Gloo.*(closed|timed out)|Timed out waiting|Broken pipe|Connection reset", re.I)


def is_secondary(type_name: str, message: str) -> bool:
    """A rank's exception that only says another rank went away (its cause is elsewhere)."""
    return bool(_SECONDARY.search(f"{type_name}: {message}"))


def is_transient(error: BaseException) -> bool:
    """A failure a relaunch can fix: a rank's process died or stalled, or a connection broke."""
    if isinstance(error, RankStalledError):
        return True
    if isinstance(error, RankFailedError):
        primary = error.failures[0]  # causes first (RankFailedError sorts them)
        return primary.exit_code == EXIT_RUNTIME and (primary.secondary or primary.type in TRANSIENT_TYPES)
    if isinstance(error, LaunchError):
        return error.rank_lost
    return False


@dataclass(frozen=True)
class Decision:
    action: str  # RETRY or RAISE
    reason: str  # in words, for the log (and, on RETRY, the run directory's restart record)
    # Whether the reason is worth an error line of its own: an error that is simply not
    # retryable speaks for itself when it is raised.
    announce: bool = False


@dataclass(frozen=True)
class FailurePolicy:
    max_restarts: int  # launch.max_restarts
    resume: str = "auto"  # checkpoint.resume: a relaunch resumes from a checkpoint only with auto

    def decide(self, error: BaseException, restarts_so_far: int) -> Decision:
        if not is_transient(error):
            return Decision(RAISE, f"not retryable: {first_line(error)}")
        if restarts_so_far >= self.max_restarts:
            return Decision(RAISE, f"giving up after launch.max_restarts={self.max_restarts} restart(s)",
                            announce=bool(self.max_restarts))
        if self.resume != "auto":
            return Decision(RAISE, f"not restarting the ranks: checkpoint.resume={self.resume} would start again "
                                   "from step 0 (set checkpoint.resume=auto)", announce=True)
        return Decision(RETRY, first_line(error))


__all__ = ["RAISE", "RETRY", "TRANSIENT_TYPES", "Decision", "FailurePolicy", "is_secondary", "is_transient"]
