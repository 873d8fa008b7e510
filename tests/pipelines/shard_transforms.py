"""Transforms the tests name as ``transform: module:function`` (importable on local executors)."""


def add_ratio(df):
    from pyspark.sql import functions as F

    return df.withColumn("ratio", F.col("x") / (F.col("extra") + 1.0))
