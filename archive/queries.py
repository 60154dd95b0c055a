"""Reading the archive safely: filters as bound parameters, and ad-hoc SQL that can only read.

`specwatch query sql` runs here: one read-only statement, checked before it reaches the
engine, which runs it with ``readonly=1`` and stops it at its time and row limits.
"""

from __future__ import annotations

import math
import re
import threading
from typing import Any

from specwatch.archive.errors import ArchiveError, ArchiveQueryLimit

__all__ = ["DEFAULT_SQL_MAX_ROWS", "DEFAULT_SQL_MAX_SECONDS", "read_only_query", "where_clause"]

# readonly=1 is the engine-side guard for ad-hoc SQL; the statement check in
# `_read_only_statement` refuses early and also covers what readonly lets through
# (INTO OUTFILE writes files, several statements in one string).
_SQL_SETTINGS = {"readonly": 1}
# Ad-hoc SQL is bounded by the engine: a runaway scan stops with a message, not a kill -9.
DEFAULT_SQL_MAX_SECONDS = 30.0
DEFAULT_SQL_MAX_ROWS = 100_000
# ClickHouse error codes that mean "a limit of ours was hit", and which limit.
_LIMIT_CODES = {159: "max_execution_time", 396: "max_result_rows"}
_READ_ONLY_KEYWORDS = ("SELECT", "WITH", "SHOW", "DESCRIBE", "DESC")
_FILTER_TYPES = {"bundle_id": "String", "bucket": "String", "cohort": "String", "reason": "String",
                 "action": "String", "kind": "String", "source": "String"}


def read_only_query(client: Any, database: str, statement: str, lock: threading.Lock, *,
                    max_seconds: float = DEFAULT_SQL_MAX_SECONDS,
                    max_rows: int = DEFAULT_SQL_MAX_ROWS) -> tuple[list[str], list[tuple]]:
    """Run a read-only statement (SELECT, WITH, SHOW, DESCRIBE) on ``client``; returns (columns, rows).

    Names without a database resolve in ``database``. Anything but a read raises ValueError
    before it reaches the engine, which runs it with ``readonly=1`` as well. The engine stops
    the statement after ``max_seconds`` or past ``max_rows`` result rows (`ArchiveQueryLimit`);
    any other engine error raises `ArchiveError`. ``lock`` is held while the client is used.
    """
    from clickhouse_connect.driver.exceptions import ClickHouseError

    if not max_seconds > 0 or not math.isfinite(max_seconds):
        raise ValueError(f"max_seconds must be a positive number of seconds, not {max_seconds!r}")
    if not isinstance(max_rows, int) or max_rows < 1:
        raise ValueError(f"max_rows must be a positive whole number, not {max_rows!r}")
    statement = _read_only_statement(statement)
    limits = {"max_execution_time": max_seconds, "max_result_rows": max_rows}
    settings = dict(_SQL_SETTINGS, result_overflow_mode="throw", **limits)
    try:
        with lock:
            current = getattr(client, "database", None)
            client.database = database
            try:
                result = client.query(statement, settings=settings)
            finally:
                client.database = current
    except ClickHouseError as exc:
        # The engine's first line says what is wrong; the rest is its stack trace.
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        code = re.search(r"Code: (\d+)", message)
        setting = _LIMIT_CODES.get(int(code.group(1))) if code else None
        if setting is not None:
            raise ArchiveQueryLimit(setting, limits[setting]) from exc
        raise ArchiveError(f"query failed: {message}") from exc
    return list(result.column_names), list(result.result_rows)


def where_clause(**given: Any) -> tuple[str, dict[str, Any]]:
    """A WHERE clause with bound parameters for the filters that are set.

    >>> where, params = where_clause(bundle_id="b-1", bucket="*", since=5.0, until=None)
    >>> where
    ' WHERE bundle_id = {bundle_id:String} AND bucket IS NULL AND ts >= {since:Float64}'
    >>> params
    {'bundle_id': 'b-1', 'since': 5.0}
    """
    clauses, params = [], {}
    for name, value in given.items():
        if value is None:
            continue
        if name in ("since", "until"):
            clauses.append(f"ts {'>=' if name == 'since' else '<='} {{{name}:Float64}}")
            params[name] = float(value)
        elif name in ("bucket", "cohort") and value == "*":
            clauses.append(f"{name} IS NULL")  # "*" is how scope keys spell "all"
        else:
            clauses.append(f"{name} = {{{name}:{_FILTER_TYPES[name]}}}")
            params[name] = value
    return (" WHERE " + " AND ".join(clauses) if clauses else ""), params


def _read_only_statement(statement: str) -> str:
    """The statement, if it is one read-only query; raises ValueError otherwise.

    >>> _read_only_statement("  -- last hour\\n select count() from specwatch.decisions;")
    '-- last hour\\n select count() from specwatch.decisions'
    >>> _read_only_statement("DROP TABLE specwatch.decisions")
    Traceback (most recent call last):
    ...
    ValueError: only SELECT, WITH, SHOW and DESCRIBE statements may run here, not DROP
    >>> _read_only_statement("SELECT ';' AS x; DROP TABLE x")
    Traceback (most recent call last):
    ...
    ValueError: one statement at a time: found more after ';'
    """
    code = _blank_literals(statement)
    end = len(code.rstrip())
    if end and code[end - 1] == ";":  # one trailing ';' is harmless; drop it
        statement, code = statement[:end - 1] + statement[end:], code[:end - 1] + code[end:]
    if ";" in code:
        raise ValueError("one statement at a time: found more after ';'")
    words = [w.upper() for w in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", code)]
    if not words:
        raise ValueError("empty statement")
    if words[0] not in _READ_ONLY_KEYWORDS:
        raise ValueError(f"only SELECT, WITH, SHOW and DESCRIBE statements may run here, not {words[0]}")
    if any(a == "INTO" and b == "OUTFILE" for a, b in zip(words, words[1:])):
        raise ValueError("INTO OUTFILE writes files; not allowed here")
    return statement.strip()


def _blank_literals(statement: str) -> str:
    """The statement with string literals, quoted names and comments blanked out.

    Positions are kept (every character maps to one), so what is found in the
    result can be cut from the original.

    >>> code = _blank_literals("SELECT ';' AS s -- z;")
    >>> code.split(), len(code)
    (['SELECT', 'AS', 's'], 21)
    """
    out = list(statement)
    i, n = 0, len(statement)
    while i < n:
        c = statement[i]
        if c in "'\"`":
            j = i + 1
            while j < n and statement[j] != c:
                j += 2 if statement[j] == "\\" else 1
            j = min(j + 1, n)
        elif statement.startswith("--", i) or c == "#":
            j = statement.find("\n", i)
            j = n if j < 0 else j
        elif statement.startswith("/*", i):
            j = statement.find("*/", i + 2)
            j = n if j < 0 else j + 2
        else:
            i += 1
            continue
        out[i:j] = " " * (j - i)
        i = j
    return "".join(out)
