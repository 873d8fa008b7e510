"""A Hive metastore of a test's own (embedded Derby under a temporary directory: tables that
outlive the process that wrote them), and, run as a script, a reader of it: open the metastore in
``argv[1]`` and print, as one JSON line, every table of schema ``argv[2]`` with its rows (id,
probabilities) sorted by id. A process of its own, because embedded
Derby lets one JVM at a time open the metastore."""

import json
import sys


def hive_conf(root: str) -> dict:
    """spark.conf for a session whose catalog is the Hive metastore under ``root``."""
    return {"spark.sql.catalogImplementation": "hive", "spark.sql.warehouse.dir": f"{root}/warehouse",
            "spark.hadoop.javax.jdo.option.ConnectionURL": f"jdbc:derby:;databaseName={root}/metastore_db;create=true",
            "spark.driver.extraJavaOptions": f"-Dderby.system.home={root}", "spark.ui.enabled": "false",
            "spark.sql.shuffle.partitions": "2"}


def main(root: str, schema: str) -> None:
    from common.config import SparkConfig
    from common.spark import get_or_create_session

    spark = get_or_create_session(SparkConfig(master="local[1]", app_name="table-reader", conf=hive_conf(root)))
    found = {}
    for row in spark.sql(f"SHOW TABLES IN {schema}").collect():
        # A test's few hundred scores: collecting them is the point here.
        rows = spark.table(f"{schema}.{row['tableName']}").select("id", "probabilities").orderBy("id").collect()
        found[row["tableName"]] = [[r["id"], [float(p) for p in r["probabilities"]]] for r in rows]
    spark.stop()
    print("READ " + json.dumps(found))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
