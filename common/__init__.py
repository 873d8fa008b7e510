"""shardtrain's foundation: what the stages stand on, and nothing stage-specific.

- ``errors``          every exception raised on purpose, and its exit status (2 = fix the input, 1 = retry)
- ``config``          typed config trees: YAML -> overrides -> checked dataclasses; ``SparkConfig``
- ``storage``         URIs (local, s3://, hdfs://, dbfs:/), their file systems, whole-file writes, exact-path listing
- ``commit_marker``   the ``_COMMITTED`` marker that makes a directory an output, and the output kinds it records
- ``publish``         the atomic-publish protocol: staging, commit, the overwrite swap; readers' ``require_committed``
- ``writer_lock``     one writer per output (``output_lock``, ``writing_under``)
- ``output_guard``    what an output path may replace or overlap (``check_replaceable``, ``check_disjoint``)
- ``output_mode``     what ``error`` / ``overwrite`` / ``skip_if_exists`` do with an output already there
- ``leases``          training runs' reader leases on datasets
- ``sql``             quoting users' names and literals in Spark SQL; the check that a ``query`` is a query
- ``dataset``         the dataset contract: the manifest ``pipelines`` writes and ``training`` reads
- ``tasks``           each task's label contract (class label or value, stored dtype, a transfer row's marker)
- ``sources``         the ``sources`` config section and reading it (the shard and score jobs)
- ``rows``            the row rules of a raw feature value (quarantine reasons, typing), for the shard job and scoring
- ``model_artifact``  a published model read back and verified (``training.export`` publishes it)
- ``spark``           the one SparkSession factory, and readable Spark errors
- ``devices``         which device a process computes on (Spark GPU addresses, CUDA_VISIBLE_DEVICES)
- ``cli``             command plumbing: config arguments, logging, error -> exit status
- ``plugins``         loading user code named as ``module:function``
- ``html_report``     self-contained HTML pages with embedded PNG charts
- ``faults``          the one fault-injection point (``SHARDTRAIN_FAULT``), for tests

It imports neither ``pipelines`` nor ``training`` nor ``scoring``. Importing it stays cheap and
Spark-free: executors and training ranks import ``common.storage``, ``common.publish`` and
``common.dataset``; torch and pyspark are imported inside the functions that need them.
"""

__version__ = "0.1.0"
