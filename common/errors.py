"""Every exception shardtrain raises on purpose, for both stages, and the exit status each maps to.

Schedulers (Airflow, cron, Databricks jobs) branch on exit status, so the split is fixed:
2 means "the input you gave is wrong, retrying will not help" (config, URI, dataset contract),
1 means "the run failed" (a worker died, a quality gate tripped) and may be retried.
"""

from __future__ import annotations

from dataclasses import dataclass

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (Spark's run to pages), or its type's name."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


class ShardtrainError(Exception):
    """Base class: an error whose message is meant for the user as-is (no traceback needed)."""

    exit_code = EXIT_RUNTIME


class ConfigError(ShardtrainError):
    """A config file, key, value or command-line override is wrong."""

    exit_code = EXIT_USAGE


class StorageError(ShardtrainError):
    """A URI cannot be used: unknown scheme, missing credentials, uncommitted output."""

    exit_code = EXIT_USAGE


class StorageIOError(StorageError):
    """Reading or writing a path failed (permissions, disk, network); the message names the path."""

    exit_code = EXIT_RUNTIME


class OutputLockedError(ShardtrainError):
    """Another job holds the output's writer lock; the message names it. Retry when it is done."""

    exit_code = EXIT_RUNTIME


class DatasetError(ShardtrainError):
    """A dataset (its manifest) breaks the contract between pipelines/ and training/."""

    exit_code = EXIT_USAGE


class DatasetChangedError(ShardtrainError):
    """A dataset a training run planned on was rewritten (its manifest or a file) while the run read
    it; the run stops before publishing. The input was fine when the run started: exit 1."""

    exit_code = EXIT_RUNTIME


class InputDataError(ShardtrainError):
    """The raw input cannot be processed: missing column, uncastable type, too many bad rows."""

    exit_code = EXIT_USAGE


class QualityGateError(ShardtrainError):
    """More rows were quarantined than quality.max_bad_fraction allows."""

    exit_code = EXIT_RUNTIME


class OutputExistsError(ShardtrainError):
    """output.mode=error and the output is already there."""

    exit_code = EXIT_USAGE


class SparkJobError(ShardtrainError):
    """A Spark job failed; the message carries the failing task's own Python error."""


class AccountingError(ShardtrainError):
    """Input rows != published + quarantined rows: a bug or a non-deterministic input; nothing is published."""


class RunDirError(ShardtrainError):
    """A training run directory is missing, or lacks or garbles a file a report reads; names the path."""

    exit_code = EXIT_USAGE


class CorruptCheckpoint(Exception):
    """A checkpoint file cannot be read back; the manager falls back to the previous one."""


# --- training ---------------------------------------------------------------------------------
# Rank-side failures travel to the driver as plain data (``RankFailure``), never as pickled
# exception objects: an executor's exception class may not even import on the driver.

class TrainingError(ShardtrainError):
    """Training ran and failed (a rank raised, the loss diverged); retrying may help. Exit 1."""

    exit_code = EXIT_RUNTIME


class NonFiniteLossError(TrainingError):
    """The loss became NaN/inf: the message names the optimizer step and the rank."""


class LaunchError(TrainingError):
    """The ranks could not be started or did not finish (slots, timeouts, a crashed process).
    ``rank_lost``: what the launcher saw, a rank's process or task went away (died, was killed,
    its executor was lost), unlike a launch that could not start. Whether a failure is retried is
    decided in one place, ``training.launchers.failure_policy``, from facts like this one."""

    def __init__(self, message: str, rank_lost: bool = False):
        super().__init__(message)
        self.rank_lost = rank_lost


class RankStalledError(LaunchError):
    """A rank made no progress for launch.stall_timeout_s; the message names it and every rank's step."""

    def __init__(self, message: str):
        super().__init__(message)


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
    """One or more ranks raised; the message carries each rank's own traceback (causes first),
    except where the cause is the input (exit 2: a config or data error found on the ranks): its
    one line says what to change, and the ranks' tracebacks would only bury it."""

    def __init__(self, failures: list[RankFailure]):
        self.failures = sorted(failures, key=lambda f: (f.secondary, f.rank))
        primary = self.failures[0]
        # A rank's own usage error (e.g. a missing column) keeps its exit status.
        self.exit_code = primary.exit_code
        first = f"training failed on rank {primary.rank}: {primary.type}: {primary.message}"
        if primary.exit_code == EXIT_USAGE:
            same = [f.rank for f in self.failures[1:] if (f.type, f.message) == (primary.type, primary.message)]
            also = f" (rank(s) {', '.join(map(str, same))} too)" if same else ""
            super().__init__(first.replace(":", also + ":", 1))
            return
        lines = [first]
        for f in self.failures:
            lines.append(f"\n--- rank {f.rank} traceback ---\n{f.traceback.rstrip()}")
        super().__init__("\n".join(lines))
