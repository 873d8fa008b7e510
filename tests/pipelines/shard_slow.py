"""A transform that passes rows through unchanged but sleeps per partition, so a test can kill an
executor while the shard job is still running. Shipped to spark-submit with --py-files."""


def sleepy(df):
    def slow(batches):
        import time

        time.sleep(1.5)
        yield from batches

    return df.mapInArrow(slow, df.schema)
