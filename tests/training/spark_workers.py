"""What Spark's Python workers hold, for the torch_tasks tests (whose ranks run inside them)."""

from __future__ import annotations


def python_workers(spark, names: tuple[str, ...] = ()) -> list[tuple[bool, str]]:
    """Per task of a 2-task barrier job on ``spark`` (on local[2]: both idle Python workers): whether
    torch is already imported there (the worker ran a rank and lives on), and which of ``names`` are
    set in its environment (comma-separated)."""

    def probe(batches):  # nested: pickled by value (the workers cannot import the tests' modules)
        import os
        import sys

        import pandas as pd

        for _ in batches:
            pass
        yield pd.DataFrame({"torch": ["torch" in sys.modules], "left": [",".join(k for k in names if k in os.environ)]})

    rows = spark.range(0, 2, 1, 2).mapInPandas(probe, "torch boolean, left string", barrier=True).collect()
    return [(row["torch"], row["left"]) for row in rows]
