"""The postmortem queries `specwatch query` runs, with filters as bound parameters, and ad-hoc
SQL checked to be one read-only statement, run with ``readonly=1`` under time and row limits."""

from __future__ import annotations

import json
import math
import re
import threading
from typing import Any, Mapping

from specwatch.archive.columns import DECISIONS, WINDOW_STATS_FIELDS
from specwatch.archive.errors import ArchiveError, ArchiveQueryLimit
from specwatch.archive.rows import WINDOW_ARRAYS, audit_out, decision_out, window_out

__all__ = ["DEFAULT_SQL_MAX_MEMORY_MIB", "DEFAULT_SQL_MAX_ROWS", "DEFAULT_SQL_MAX_SECONDS", "PostmortemQueries", "where_clause"]

# readonly=1 is the engine-side guard for ad-hoc SQL; the statement check in
# `_read_only_statement` refuses early and also covers what readonly lets through
# (INTO OUTFILE writes files, several statements in one string).
_SQL_SETTINGS = {"readonly": 1}
# Ad-hoc SQL is bounded by the engine: a runaway scan stops with a message, not a kill -9.
DEFAULT_SQL_MAX_SECONDS = 30.0
DEFAULT_SQL_MAX_ROWS = 100_000
# Memory is the third bound: one GROUP BY over every window row took 14 GB of the machine
# (chDB runs inside this process); 2 GiB answers any postmortem question about one archive.
DEFAULT_SQL_MAX_MEMORY_MIB = 2048
_MIB = 1 << 20
# ClickHouse error codes that mean "a limit of ours was hit", and which limit.
_LIMIT_CODES = {159: "max_execution_time", 396: "max_result_rows", 241: "max_memory_usage"}
_READ_ONLY_KEYWORDS = ("SELECT", "WITH", "SHOW", "DESCRIBE", "DESC")
# A quoted string or name (backslash escapes, unterminated up to the end), or a comment.
_NOT_CODE = re.compile(r"""(['"`])(?:\\.|\\\Z|(?!\1)[^\\])*\1?"""
                       r"|(?:--|\#)[^\n]*|/\*.*?(?:\*/|\Z)", re.S)
_DEFAULT_DECISIONS_LIMIT = 100
_DECISION_COLUMNS = ", ".join(DECISIONS.insert_names)
_FILTER_TYPES = {"bundle_id": "String", "bucket": "String", "cohort": "String", "reason": "String",
                 "action": "String", "kind": "String"}


class PostmortemQueries:
    """The read side of `Archive` (its base class), through the archive's client and lock."""

    _client: Any
    _db: str
    _lock: threading.Lock

    def _select(self, sql: str, parameters: Mapping[str, Any] | None = None) -> list[dict]:
        raise NotImplementedError

    def decisions(self, bundle_id: str | None = None, bucket: str | None = None,
                  reason: str | None = None, action: str | None = None,
                  since: float | None = None, until: float | None = None,
                  limit: int | None = _DEFAULT_DECISIONS_LIMIT) -> list[dict]:
        """The most recent `limit` matching decisions, oldest first. ``bucket="*"`` selects whole-
        bundle decisions; ``since``/``until`` are inclusive unix seconds; ``limit=None`` returns
        every match."""
        where, params = where_clause(bundle_id=bundle_id, bucket=bucket, reason=reason, action=action,
                                     since=since, until=until)
        sql = (f"SELECT {_DECISION_COLUMNS} FROM {self._db}.decisions FINAL{where} "
               "ORDER BY ts DESC, archived_at DESC, decision_id DESC")
        if limit is not None:
            if limit < 0:
                raise ValueError(f"limit must be >= 0 (or None for every match), not {limit}")
            sql += f" LIMIT {int(limit)}"
        rows = [decision_out(r) for r in self._select(sql, params)]
        rows.reverse()
        return rows

    def decision(self, decision_id: str) -> dict | None:
        """One decision with its audit row (JSON fields parsed) under ``"audit"``."""
        rows = self._select(f"SELECT {_DECISION_COLUMNS} FROM {self._db}.decisions FINAL "
                            "WHERE decision_id = {id:String} LIMIT 1", {"id": decision_id})
        if not rows:
            return None
        out = decision_out(rows[0])
        audit = self._select(f"SELECT * EXCEPT archived_at FROM {self._db}.audit FINAL "
                             "WHERE audit_id = {id:String} LIMIT 1", {"id": f"a-{decision_id}"})
        out["audit"] = audit_out(audit[0]) if audit else None
        return out

    def samples(self, decision_id: str) -> list[dict]:
        """The samples archived with a decision, ``record`` parsed back to a dict."""
        rows = self._select(f"SELECT * FROM {self._db}.samples FINAL "
                            "WHERE decision_id = {id:String} ORDER BY ts, kind, sample_id",
                            {"id": decision_id})
        for row in rows:
            row["record"] = json.loads(row["record"])
        return rows

    def timeline(self, bundle_id: str | None = None, bucket: str | None = None,
                 cohort: str | None = None, since: float | None = None,
                 until: float | None = None) -> list[dict]:
        """Window-stats rows in slice order (``bucket``/``cohort`` ``"*"`` = whole-bundle rows)."""
        where, params = where_clause(bundle_id=bundle_id, bucket=bucket, cohort=cohort, since=since,
                                     until=until)
        present = {r["name"] for r in self._select(
            "SELECT name FROM system.columns WHERE database = {db:String} AND table = 'window_stats'",
            {"db": self._db})}
        # An archive opened read-only from before the added columns reads them as empty.
        columns = ", ".join(name if name in present else
                            f"{'emptyArrayUInt64()' if name in WINDOW_ARRAYS else 'toUInt64(0)'} AS {name}"
                            for name in WINDOW_STATS_FIELDS)
        rows = self._select(f"SELECT {columns} FROM {self._db}.window_stats "
                            f"FINAL{where} ORDER BY ts, bundle_id, bucket, cohort", params)
        return [window_out(row) for row in rows]

    def bundles(self) -> list[dict]:
        """Every bundle seen: card, first/last seen and the workers that ran it, and each
        worker's own span under ``sightings`` (``worker``, ``first_seen``, ``last_seen``)."""
        cards = self._select(
            "SELECT bundle_id, any(card) AS card, min(first_seen) AS first_seen, "
            "max(last_seen) AS last_seen, arraySort(groupUniqArrayArray(workers)) AS workers "
            f"FROM {self._db}.bundles GROUP BY bundle_id")
        # An archive written before per-worker sightings has only the card table.
        spans = self._select(
            "SELECT bundle_id, worker, min(first_seen) AS first_seen, max(last_seen) AS last_seen "
            f"FROM {self._db}.bundle_sightings GROUP BY bundle_id, worker ORDER BY bundle_id, worker"
        ) if self._select(f"EXISTS TABLE {self._db}.bundle_sightings")[0]["result"] else []
        by_bundle = {row["bundle_id"]: dict(row, card=json.loads(row["card"]), sightings=[])
                     for row in cards}
        for span in spans:
            # A bundle seen only in steps so far (its card not yet archived) is listed without one.
            row = by_bundle.setdefault(span["bundle_id"], {
                "bundle_id": span["bundle_id"], "card": None, "first_seen": span["first_seen"],
                "last_seen": span["last_seen"], "workers": [], "sightings": []})
            row["sightings"].append({"worker": span["worker"], "first_seen": span["first_seen"],
                                     "last_seen": span["last_seen"]})
            row["first_seen"] = min(row["first_seen"], span["first_seen"])
            row["last_seen"] = max(row["last_seen"], span["last_seen"])
            if span["worker"] not in row["workers"]:
                row["workers"] = sorted([*row["workers"], span["worker"]])
        return sorted(by_bundle.values(), key=lambda row: (row["first_seen"], row["bundle_id"]))

    def knows_bundle(self, bundle_id: str) -> bool:
        """Whether anything in the archive names this bundle: a sighting, window stats or a decision."""
        tables = ("bundles", "window_stats", "decisions")
        found = self._select("SELECT " + " OR ".join(
            f"(SELECT count() FROM {self._db}.{table} WHERE bundle_id = {{id:String}}) > 0" for table in tables)
            + " AS known", {"id": bundle_id})
        return bool(found[0]["known"])

    def sql(self, statement: str, max_seconds: float = DEFAULT_SQL_MAX_SECONDS,
            max_rows: int = DEFAULT_SQL_MAX_ROWS,
            max_memory_mib: int = DEFAULT_SQL_MAX_MEMORY_MIB) -> tuple[list[str], list[tuple]]:
        """Run a read-only statement (SELECT, WITH, SHOW, DESCRIBE); returns (columns, rows). Names
        without a database resolve in the archive's database. Anything but a read raises ValueError;
        past ``max_seconds``, ``max_rows`` or ``max_memory_mib`` the engine stops it
        (`ArchiveQueryLimit`; readonly=1 keeps a statement's own SETTINGS from lifting them); any
        other engine error raises `ArchiveError`. An empty result may have no column names."""
        from clickhouse_connect.driver.exceptions import ClickHouseError

        if not max_seconds > 0 or not math.isfinite(max_seconds):
            raise ValueError(f"max_seconds must be a positive number of seconds, "
                             f"not {max_seconds!r}")
        if not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"max_rows must be a positive whole number, not {max_rows!r}")
        if not isinstance(max_memory_mib, int) or isinstance(max_memory_mib, bool) or max_memory_mib < 1:
            raise ValueError(f"max_memory_mib must be a positive whole number of MiB, not {max_memory_mib!r}")
        statement = _read_only_statement(statement)
        limits = {"max_execution_time": max_seconds, "max_result_rows": max_rows,
                  "max_memory_usage": max_memory_mib * _MIB}
        settings = dict(_SQL_SETTINGS, result_overflow_mode="throw", **limits)
        client = self._client
        try:
            with self._lock:
                current = getattr(client, "database", None)
                client.database = self._db
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
    """The statement with string literals, quoted names and comments blanked out, positions kept.

    >>> code = _blank_literals("SELECT ';' AS s -- z;")
    >>> code.split(), len(code)
    (['SELECT', 'AS', 's'], 21)
    """
    return _NOT_CODE.sub(lambda found: " " * len(found.group()), statement)
