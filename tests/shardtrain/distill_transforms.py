"""Transforms tests/shardtrain/test_distill_loop.py and test_transfer_set.py name as ``transform: module:function``."""


def tiny_partitions(df):
    """The same rows in partitions of about 10 rows: where a batched matmul's last bits differ
    from those of the same rows in a large batch (measured: batches under 16 rows, on CPU)."""
    return df.repartition(150)


def unlabel_every_third(df):
    """A third of the rows lose their label (a transfer set once the shard job keeps them), and
    every 97th row gets a class that does not exist (still quarantined as invalid_label)."""
    return df.selectExpr(*[c for c in df.columns if c != "label"],
                         "CASE WHEN id % 3 = 0 THEN NULL WHEN id % 97 = 1 THEN 7 ELSE label END AS label")


def unlabel_every_third_in_tiny_partitions(df):
    """unlabel_every_third's rows, in tiny_partitions: a rerun of the transfer set's shard job over
    the same rows laid out in other input partitions."""
    return tiny_partitions(unlabel_every_third(df))
