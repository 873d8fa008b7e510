"""A user's query must be one query that reads (common.sql.why_not_a_query): the tokenizer's view of
comments, literals and backquoted names, and each way Spark SQL lets a statement write. The probe
on real Spark (a directory's files deleted by a "query") is in tests/pipelines/test_bad_inputs.py."""

import pytest

from common.sql import why_not_a_query


@pytest.mark.parametrize("sql", [
    "SELECT * FROM raw",
    "select a, b from raw -- INSERT OVERWRITE DIRECTORY '/x'\n",
    "WITH c AS (SELECT 1 AS x) SELECT x FROM c",
    "(SELECT 1) UNION ALL (SELECT 2)",
    "VALUES (1, 2)",
    "FROM raw SELECT *",
    "TABLE raw",
    "SELECT 'a; INSERT INTO t' AS s;",  # in a literal, and a trailing ';'
    "SELECT `update`, `insert` FROM t",  # backquoted names
    "SELECT 'it\\'s' AS s, \"say \\\"INSERT\\\"\" AS d, r'\\' AS raw_backslash FROM t",
    "/* a /* nested */ INSERT */ SELECT 1",
    "SELECT /*+ BROADCAST(b) */ * FROM a JOIN b ON a.id = b.id WHERE a.x IN (SELECT x FROM c)",
])
def test_queries_that_read_are_accepted(sql):
    assert why_not_a_query(sql) is None


@pytest.mark.parametrize("sql, why", [
    ("INSERT OVERWRITE DIRECTORY '/tmp/x' SELECT 1", "starts with INSERT"),
    ("WITH c AS (SELECT 1) INSERT INTO t SELECT * FROM c", "holds INSERT outside parentheses"),
    ("FROM raw INSERT OVERWRITE TABLE t SELECT *", "holds INSERT outside parentheses"),
    ("WITH c AS (SELECT 1) MERGE INTO t USING c ON t.id = c.id WHEN MATCHED THEN DELETE", "holds MERGE"),
    ("SELECT 1; DROP TABLE t", "more than one statement"),
    ("SELECT 1 -- fine\n; CREATE TABLE t AS SELECT 1", "more than one statement"),
    ("CREATE TABLE t AS SELECT 1", "starts with CREATE"),
    ("CACHE TABLE x AS SELECT 1", "starts with CACHE"),
    ("SET spark.sql.shuffle.partitions=1", "starts with SET"),
    ("  -- only a comment", "is empty"),
    ("SELECT 'never closed", "string literal opened at character 8 and never closed"),
    ("SELECT 1 /* never closed", "/* comment opened at character 10"),
    ("SELECT `never closed", "backquoted name opened at character 8"),
    ("SELECT * FROM t WHERE s = '${hivevar:x}'", "holds '${'"),
    ("SELECT update FROM t", "backquoted: `update`"),
])
def test_anything_else_is_refused_saying_why(sql, why):
    assert why in (why_not_a_query(sql) or "accepted")
