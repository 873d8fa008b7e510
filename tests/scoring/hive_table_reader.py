"""A Hive metastore of a test's own (embedded Derby under a temporary directory: tables that
outlive the process that wrote them), and two readers of it, each in a process of its own because
embedded Derby admits one JVM at a time:

- ``read_metastore(root, schema)``: the metastore's own tables (TBLS, DBS, SDS, SERDE_PARAMS) read
  over JDBC by HiveMetastoreTables.java (compiled once per process, then a JVM of about a second
  per read, no Spark) give each table's folder, and pyarrow reads the Parquet files there;
- run as a script (``argv[1]`` the root, ``argv[2]`` the schema), Spark with the metastore as its
  catalog reads every table, as a user would; with ``--score`` and a score command's arguments
  after them, that command (``shardtrain.cli.main``) runs first in the script's process, and the
  read is on a new session of its application (a catalog of its own: the tables come from the
  metastore), which saves a Spark start-up; with ``--then-stop-at WHERE:STEP PID_FILE`` and a second
  score command's arguments after those, that command runs next on the same application with
  ``SHARDTRAIN_FAULT=WHERE:STEP:stop`` (common/faults.py): it stops itself there, for the test to
  kill, which saves another.

Both return every table of the schema with its rows (id, probabilities) sorted by id:
{name: [[id, [p, ...]], ...]}; the script prints it as one JSON line after ``READ ``."""

import glob
import json
import os
import shutil
import subprocess
import sys

from common.faults import FAULT_ENV, FAULT_ONCE_ENV

HERE = os.path.dirname(os.path.abspath(__file__))


def hive_conf(root: str) -> dict:
    """spark.conf for a session whose catalog is the Hive metastore under ``root``."""
    return {"spark.sql.catalogImplementation": "hive", "spark.sql.warehouse.dir": f"{root}/warehouse",
            "spark.hadoop.javax.jdo.option.ConnectionURL": f"jdbc:derby:;databaseName={root}/metastore_db;create=true",
            "spark.driver.extraJavaOptions": f"-Dderby.system.home={root}", "spark.ui.enabled": "false",
            "spark.sql.shuffle.partitions": "2"}


def _java() -> str:
    home = os.environ.get("JAVA_HOME")
    java = os.path.join(home, "bin", "java") if home else shutil.which("java")
    assert java and os.access(java, os.X_OK), "no java: set JAVA_HOME or put java on PATH (Spark needs it too)"
    return java


_compiled: dict[str, str] = {}  # java -> the folder HiveMetastoreTables.class was compiled to, once per process


def _reader_class_path(java: str) -> str:
    """HiveMetastoreTables.java compiled once per test process (javac of the same JDK as ``java``):
    each read then starts a plain JVM, not the source launcher's compiler again."""
    if java not in _compiled:
        import atexit
        import tempfile

        classes = tempfile.mkdtemp(prefix="hive-metastore-tables-")
        atexit.register(shutil.rmtree, classes, True)
        source = os.path.join(HERE, "HiveMetastoreTables.java")
        javac = os.path.join(os.path.dirname(os.path.realpath(java)), "javac")
        if os.access(javac, os.X_OK):
            command = [javac, "-J-XX:TieredStopAtLevel=1", "-d", classes, source]
        else:  # a JDK without the javac launcher: its compiler module, as the source launcher uses
            command = [java, "-XX:TieredStopAtLevel=1", "-m", "jdk.compiler/com.sun.tools.javac.Main", "-d", classes,
                       source]
        out = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        _compiled[java] = classes
    return _compiled[java]


def metastore_locations(root: str, schema: str = "default") -> dict[str, str]:
    """{table: folder of its data} for every table of ``schema``, from the metastore's own tables."""
    import pyspark

    jars = sorted(glob.glob(os.path.join(os.path.dirname(pyspark.__file__), "jars", "derby*.jar")))
    assert jars, f"pyspark {pyspark.__version__} ships no derby jar"
    java = _java()
    # C1 only: a JVM that boots Derby and runs one query never pays back C2's compile time.
    out = subprocess.run([java, "-XX:TieredStopAtLevel=1", f"-Dderby.system.home={root}", "-cp",
                          os.pathsep.join([_reader_class_path(java), *jars]), "HiveMetastoreTables",
                          f"{root}/metastore_db", schema],
                         cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def read_metastore(root: str, schema: str = "default") -> dict:
    """Every table of ``schema`` with its rows, read from the Parquet files at its location."""
    import pyarrow.parquet as pq

    found = {}
    for name, location in metastore_locations(root, schema).items():
        rows = pq.read_table(location.replace("file:", "", 1), columns=["id", "probabilities"]).sort_by("id")
        found[name] = [[i, [float(p) for p in probs]] for i, probs in
                       zip(rows.column("id").to_pylist(), rows.column("probabilities").to_pylist())]
    return found


def main(root: str, schema: str, score_argv: list[str] | None = None, then_stop_at: list[str] | None = None) -> None:
    from common.config import SparkConfig
    from common.spark import get_or_create_session

    if score_argv is not None:
        from shardtrain.cli import main as shardtrain

        code = shardtrain(["score", *score_argv])  # its session is built from its config's spark section
        print(f"SCORED {code}", flush=True)
        if code != 0:
            sys.exit(code)
    # The score command's session when it ran here (the same metastore), else a new one.
    spark = get_or_create_session(SparkConfig(master="local[1]", app_name="table-reader", conf=hive_conf(root)))
    if score_argv is not None:
        spark = spark.newSession()  # no table the command's session has looked up is cached here
    found = {}
    for row in spark.sql(f"SHOW TABLES IN {schema}").collect():
        # A test's few hundred scores: collecting them is the point here.
        rows = spark.table(f"{schema}.{row['tableName']}").select("id", "probabilities").orderBy("id").collect()
        found[row["tableName"]] = [[r["id"], [float(p) for p in r["probabilities"]]] for r in rows]
    print("READ " + json.dumps(found), flush=True)  # flushed: a test may kill this process next
    if then_stop_at is not None:
        fault, pid_file, *argv = then_stop_at
        os.environ[FAULT_ENV], os.environ[FAULT_ONCE_ENV] = f"{fault}:stop", pid_file
        code = shardtrain(["score", *argv])  # stops itself at the fault point: the test kills it there
        print(f"SCORED {code}, never stopped at {fault}", flush=True)
        sys.exit(3)
    spark.stop()


def _split(argv: list[str], flag: str) -> tuple[list[str], list[str] | None]:
    return (argv[:argv.index(flag)], argv[argv.index(flag) + 1:]) if flag in argv else (argv, None)


if __name__ == "__main__":
    score_argv, then_stop_at = _split(sys.argv[4:], "--then-stop-at")
    main(sys.argv[1], sys.argv[2], score_argv if sys.argv[3:4] == ["--score"] else None, then_stop_at)
