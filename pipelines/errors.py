"""The exceptions shardtrain raises on purpose, and the exit status each maps to.

Schedulers (Airflow, cron, Databricks jobs) branch on exit status, so the split is fixed:
2 means "the input you gave is wrong, retrying will not help" (config, URI, dataset contract),
1 means "the run failed" (a worker died, a quality gate tripped) and may be retried.
"""

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


class DatasetError(ShardtrainError):
    """A dataset (its manifest) breaks the contract between pipelines/ and training/."""

    exit_code = EXIT_USAGE


class InputDataError(ShardtrainError):
    """The raw input cannot be processed: missing column, uncastable type, too many bad rows."""

    exit_code = EXIT_USAGE


class QualityGateError(ShardtrainError):
    """More rows were quarantined than quality.max_bad_fraction allows."""

    exit_code = EXIT_RUNTIME


class OutputExistsError(ShardtrainError):
    """output.mode=error and the output is already there."""

    exit_code = EXIT_USAGE
