"""Errors training raises on purpose (exit status from pipelines.errors: 2 = fix the input, 1 = the run failed).

Rank-side failures travel to the driver as plain data (``RankFailure``), never as pickled
exception objects: an executor's exception class may not even import on the driver.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipelines.errors import EXIT_RUNTIME, ShardtrainError


class TrainingError(ShardtrainError):
    """Training ran and failed (a rank raised, the loss diverged); retrying may help. Exit 1."""

    exit_code = EXIT_RUNTIME


class NonFiniteLossError(TrainingError):
    """The loss became NaN/inf: the message names the optimizer step and the rank."""


class LaunchError(TrainingError):
    """horovod.spark.run could not start or finish the ranks (slots, timeouts, a crashed process)."""


@dataclass
class RankFailure:
    """One rank's exception, as plain picklable values."""

    rank: int
    type: str
    message: str
    traceback: str
    exit_code: int = EXIT_RUNTIME
    # Errors that only say "another rank went away" are consequences, not causes.
    secondary: bool = False

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class RankFailedError(TrainingError):
    """One or more ranks raised; the message carries each rank's own traceback (causes first)."""

    def __init__(self, failures: list[RankFailure]):
        self.failures = sorted(failures, key=lambda f: (f.secondary, f.rank))
        primary = self.failures[0]
        # A rank's own usage error (e.g. a missing column) keeps its exit status.
        self.exit_code = primary.exit_code
        lines = [f"training failed on rank {primary.rank}: {primary.type}: {primary.message}"]
        for f in self.failures:
            lines.append(f"\n--- rank {f.rank} traceback ---\n{f.traceback.rstrip()}")
        super().__init__("\n".join(lines))
