"""shardtrain's first stage: raw data -> Spark preprocessing -> balanced Parquet shards + manifest.

Nothing here imports ``training``: data flows one way, and so do imports.
"""

__version__ = "0.1.0"
