"""shardtrain's first stage: raw data -> Spark preprocessing -> balanced Parquet shards + manifest.

Nothing here imports ``training``: data flows one way, and so do imports.

Notebook API (each runs on the active SparkSession, or builds one from the config's spark section)::

    from pipelines import generate_dataset, shard_dataset, read_manifest, describe_dataset
    data = generate_dataset("/tmp/raw", rows=200_000, array_shape=[8])
    result = shard_dataset(data.shard_config("/tmp/shards"))   # or a YAML path, or a ShardConfig
    print(describe_dataset(result.uri))

It imports ``common`` (the foundation) and never ``training`` or ``shardtrain``. Importing it
stays cheap and Spark-free: executors import ``pipelines.shard_writer`` through it.
"""

from common import __version__


def shard_dataset(config, overrides=None, spark=None, teacher_scorer=None):
    """Run the shard job. ``config``: a ShardConfig, a plain dict, or a YAML path; returns ShardResult.
    ``teacher_scorer``: runs the config's ``teacher`` (``shardtrain.teacher.teacher_scorer()``)."""
    from common.config import from_dict
    from common.spark import get_or_create_session
    from common.storage import check_uri, resolve
    from common.writer_lock import output_lock
    from pipelines.shard_config import ShardConfig, load_shard_config
    from pipelines.shard_job import check_output_path, run_shard_job

    if isinstance(config, ShardConfig):
        if overrides:
            from common.config import apply_overrides, to_dict

            config = from_dict(ShardConfig, apply_overrides(to_dict(config), list(overrides)))
    elif isinstance(config, dict):
        from common.config import apply_overrides

        config = from_dict(ShardConfig, apply_overrides(config, list(overrides or [])))
    else:
        config = load_shard_config(config, list(overrides or []))
    for uri in config.uris:
        check_uri(uri)  # a bad URI or missing credentials fails before Spark starts
    check_output_path(config)
    # The writer lock before Spark: a refused second writer starts no JVM (run_shard_job takes the
    # same lock again, re-entrant within this process, for callers that bring their own session).
    with output_lock(resolve(config.output.path).uri):
        spark = spark or get_or_create_session(config.spark)
        return run_shard_job(spark, config, teacher_scorer)


def generate_dataset(path, rows, spark=None, **options):
    """Write a synthetic dataset (see pipelines.generate.generate_dataset for the options)."""
    from pipelines.generate import generate_dataset as _generate
    from common.spark import get_or_create_session

    return _generate(spark or get_or_create_session(), path, rows, **options)


def read_manifest(uri):
    """Read and validate a published dataset's manifest (refuses uncommitted datasets)."""
    from common.dataset import read_manifest as _read

    return _read(uri)


def describe_dataset(uri) -> str:
    """A human-readable summary: splits, per-shard rows and balance, quarantine reasons."""
    from pipelines.describe import describe_dataset as _describe

    return _describe(uri)


__all__ = ["__version__", "describe_dataset", "generate_dataset", "read_manifest", "shard_dataset"]
