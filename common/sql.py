"""Spark SQL text built from user-given names and values: the one place they are quoted.

Column names come from users' tables (``price-usd``, ``first name``, ``it's``, names with
backticks or any unicode), and every SQL string the jobs build from them, the ``_n_``/``_c_``/
``_a_`` aliases of the typed values included, goes through ``quote_identifier``; text put into
a SQL string literal (a quarantine reason naming a column, a source's name, a URI) goes through
``quote_string``.

What a user's ``query`` (the shard and score jobs' ``sources`` + ``query``) may be
(``why_not_a_query``): one Spark SQL query, a ``SELECT`` that reads, never a statement that
writes. ``spark.sql`` runs any statement at once, so an ``INSERT OVERWRITE DIRECTORY '/x' SELECT ...`` given as a query deleted /x's files
before the job could look at the result.

Checked at config validation, before any Spark session exists, by a small Spark SQL tokenizer
rather than Spark's own parser: that parser is reachable only through a classic session's JVM
(``spark._jsparkSession.sessionState().sqlParser()``), not over Spark Connect, and only once a
session has started. What the tokenizer knows of Spark SQL's lexical rules: ``--`` and (nested)
``/* */`` comments, hints included; ``'...'`` and ``"..."`` string literals with backslash
escapes, ``r'...'`` raw literals without; backquoted identifiers (a doubled backquote inside).
What it then requires, outside comments, literals and identifiers:

- the first word is SELECT, WITH, VALUES, FROM or TABLE (after any opening parentheses);
- no ``;`` followed by anything but more ``;`` (one statement; a trailing ``;`` is fine);
- no INSERT, DELETE, UPDATE or MERGE outside parentheses: Spark accepts those after a CTE
  (``WITH c AS (...) INSERT ...``) and after a leading FROM (``FROM t INSERT ...``), and nowhere
  else. A column with such a name is written backquoted (```update```);
- no ``${``: Spark substitutes ``${name}`` variables into the text before parsing it, so what
  runs would not be what was checked.

Nothing here imports pyspark.
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


# --- a query must be a query -----------------------------------------------------------------

QUERY_STARTS = ("SELECT", "WITH", "VALUES", "FROM", "TABLE")
# Statements Spark accepts after a query's own leading clauses (a CTE list, a FROM clause).
WRITES = ("INSERT", "DELETE", "UPDATE", "MERGE")
_LITERAL, _IDENTIFIER = "<literal>", "<identifier>"


def why_not_a_query(sql: str) -> str | None:
    """None if ``sql`` is a single query (see the module docstring), else why not, in words."""
    if "${" in sql:
        return "holds '${', which Spark replaces with a variable's value before parsing; write the value itself"
    try:
        tokens = _tokens(sql)
    except ValueError as exc:
        return str(exc)
    words = [(word, depth) for word, depth in tokens if word not in ("(", ")")]
    if not words or words[0][0] == ";":
        return "is empty"
    first = words[0][0]
    if first not in QUERY_STARTS:
        return (f"starts with {first}, not with {' / '.join(QUERY_STARTS)}: only a query that reads is run, never a "
                "statement that writes or changes anything")
    semicolons = [i for i, (word, _) in enumerate(words) if word == ";"]
    if semicolons and any(word != ";" for word, _ in words[semicolons[0]:]):
        return "holds more than one statement (a ';' with more after it); give one query"
    for word, depth in words:
        if depth == 0 and word in WRITES:
            return (f"holds {word} outside parentheses, which makes it a statement that writes, not a query "
                    f"(a column named {word.lower()} must be backquoted: `{word.lower()}`)")
    return None


def _tokens(sql: str) -> list[tuple[str, int]]:
    """(token, parenthesis depth) for each word (upper case), parenthesis and ';' of ``sql``;
    literals and backquoted identifiers as placeholders, comments and operators dropped."""
    out: list[tuple[str, int]] = []
    depth, i, n = 0, 0, len(sql)
    while i < n:
        c = sql[i]
        if sql.startswith("--", i):
            end = sql.find("\n", i)
            i = n if end < 0 else end + 1
        elif sql.startswith("/*", i):
            i = _skip_bracketed_comment(sql, i)
        elif c in "'\"":
            i = _skip_string(sql, i, escapes=True)
            out.append((_LITERAL, depth))
        elif c == "`":
            i = _skip_backquoted(sql, i)
            out.append((_IDENTIFIER, depth))
        elif c == "(":
            out.append(("(", depth))
            depth += 1
            i += 1
        elif c == ")":
            depth = max(0, depth - 1)
            out.append((")", depth))
            i += 1
        elif c == ";":
            out.append((";", depth))
            i += 1
        elif c.isalnum() or c == "_":
            start = i
            while i < n and (sql[i].isalnum() or sql[i] == "_"):
                i += 1
            word = sql[start:i]
            if word in ("r", "R") and i < n and sql[i] in "'\"":
                i = _skip_string(sql, i, escapes=False)  # a raw literal: backslashes are plain characters
                out.append((_LITERAL, depth))
            else:
                out.append((word.upper(), depth))
        else:
            i += 1  # whitespace, operators, commas, dots
    return out


def _skip_string(sql: str, start: int, escapes: bool) -> int:
    quote, i = sql[start], start + 1
    while i < len(sql):
        if escapes and sql[i] == "\\":
            i += 2
        elif sql[i] == quote:
            return i + 1
        else:
            i += 1
    raise ValueError(f"has a string literal opened at character {start + 1} and never closed")


def _skip_backquoted(sql: str, start: int) -> int:
    i = start + 1
    while i < len(sql):
        if sql.startswith("``", i):
            i += 2
        elif sql[i] == "`":
            return i + 1
        else:
            i += 1
    raise ValueError(f"has a backquoted name opened at character {start + 1} and never closed")


def _skip_bracketed_comment(sql: str, start: int) -> int:
    level, i = 0, start
    while i < len(sql):
        if sql.startswith("/*", i):
            level, i = level + 1, i + 2
        elif sql.startswith("*/", i):
            level, i = level - 1, i + 2
            if level == 0:
                return i
        else:
            i += 1
    raise ValueError(f"has a /* comment opened at character {start + 1} and never closed")


__all__ = ["QUERY_STARTS", "WRITES", "quote_identifier", "quote_string", "why_not_a_query"]
