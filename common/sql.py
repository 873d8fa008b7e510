"""Spark SQL text built from user-given names and values: the one place they are quoted.

Column names come from users' tables (``price-usd``, ``first name``, ``it's``, names with
backticks or any unicode), and every SQL string the jobs build from them, the ``_n_``/``_c_``/
``_a_`` aliases of the typed values included, goes through ``quote_identifier``; text put into
a SQL string literal (a quarantine reason naming a column, a source's name, a URI) goes through
``quote_string``. Nothing here imports pyspark.
"""

from __future__ import annotations


def quote_identifier(name: str) -> str:
    """``name`` as a Spark SQL identifier: in backticks, a backtick inside doubled."""
    return "`" + name.replace("`", "``") + "`"


def quote_string(text: str) -> str:
    """``text`` as a Spark SQL string literal. Spark's parser unescapes backslash sequences in
    literals (spark.sql.parser.escapedStringLiterals is off by default), so a backslash is
    escaped first, then the quote."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


__all__ = ["quote_identifier", "quote_string"]
