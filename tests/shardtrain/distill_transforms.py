"""Transforms tests/shardtrain/test_distill_loop.py names as ``transform: module:function``."""


def tiny_partitions(df):
    """The same rows in partitions of about 10 rows: where a batched matmul's last bits differ
    from those of the same rows in a large batch (measured: batches under 16 rows, on CPU)."""
    return df.repartition(150)
