"""shardtrain's foundation: what both stages stand on, and nothing stage-specific.

- ``errors``   every exception raised on purpose, and its exit status (2 = fix the input, 1 = retry)
- ``config``   typed config trees: YAML -> overrides -> checked dataclasses; ``SparkConfig``
- ``storage``  URIs (local, s3://, hdfs://, dbfs:/) and the atomic-publish protocol
- ``dataset``  the dataset contract: the manifest ``pipelines`` writes and ``training`` reads
- ``rows``     the row rules of a raw feature value (quarantine reasons, typing), for the shard job and scoring
- ``spark``    the one SparkSession factory, and readable Spark errors
- ``devices``  which device a process computes on (Spark GPU addresses, CUDA_VISIBLE_DEVICES)
- ``cli``      command plumbing: config arguments, logging, error -> exit status
- ``plugins``  loading user code named as ``module:function``

It imports neither ``pipelines`` nor ``training``. Importing it stays cheap and Spark-free:
executors and training ranks import ``common.storage`` and ``common.dataset``.
"""

__version__ = "0.1.0"
