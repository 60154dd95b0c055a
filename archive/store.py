"""The ClickHouse archive: decisions, their audit trail, reproducible samples and window stats.

The pipeline writes it, `specwatch query`, `specwatch flags` and postmortems read it; chDB
(embedded, on disk) by default, a ClickHouse server one DSN away.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import itertools
import json
import logging
import math
import operator
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections import abc
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence
from urllib.parse import unquote, urlsplit

import numpy as np
import pyarrow as pa

from specwatch.actions.flags import FlagStore
from specwatch.schemas import Decision, decision_key
from specwatch.schemas.redaction import SAMPLE_TEXT_MODES, redact_record
from specwatch.schemas.sealed import sealed_key_id

__all__ = [
    "ARCHIVE_ENV",
    "DEFAULT_ARCHIVE_DSN",
    "WINDOW_STATS_FIELDS",
    "Archive",
    "ArchiveError",
    "ArchiveNotFoundError",
    "ArchiveQueryLimit",
    "DEFAULT_SQL_MAX_ROWS",
    "DEFAULT_SQL_MAX_SECONDS",
    "ArchiveWriter",
    "archive_dsn",
    "check_archive_dsn",
]

logger = logging.getLogger(__name__)

ARCHIVE_ENV = "SPECWATCH_ARCHIVE"
DEFAULT_ARCHIVE_DSN = "chdb://specwatch-data/archive"
_USER_ENV = "SPECWATCH_CLICKHOUSE_USER"
_PASSWORD_ENV = "SPECWATCH_CLICKHOUSE_PASSWORD"
# Free text in samples (a request's engine error) is archived as a digest unless a
# deployment opts in to a redacted form; never as it came (it may quote a prompt).
_SAMPLE_TEXT_ENV = "SPECWATCH_ARCHIVE_SAMPLE_TEXT"
_DEFAULT_SAMPLE_TEXT = "hashes"
_DEFAULT_DATABASE = "specwatch"
_DEFAULT_DECISIONS_LIMIT = 100
# One insert is one part on disk: big enough to amortize, small enough to bound memory
# and to overlap converting one chunk with inserting the previous one.
_DEFAULT_INSERT_CHUNK_ROWS = 65_536
_DEFAULT_WRITER_MAX_ROWS = 50_000
_DEFAULT_WRITER_MAX_DELAY_S = 2.0
# A writer whose flushes keep failing must not grow without bound: past this many
# buffered window-stats rows the oldest are dropped (and counted). Decisions are kept.
_DEFAULT_WRITER_MAX_BUFFERED = 500_000
# Deduplication is left to merges and FINAL: collapsing each inserted block on the
# way in halves insert throughput and buys nothing, since readers use FINAL anyway.
_INSERT_SETTINGS = {"optimize_on_insert": 0}
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
_SAMPLE_KINDS = ("request", "step", "shadow")

_WINDOW_COUNTS = ("rounds", "drafted_tokens", "accepted_tokens", "requests", "errors",
                  "shadow_checks", "shadow_mismatches", "steps", "plain_entries")
# Per-draft-position survival counts (`SliceStats.accepted_at_least` / `drafted_at_least`):
# what `specwatch tune` predicts acceptance at every D from.
_WINDOW_ARRAYS = ("accepted_at_least", "drafted_at_least")
_WINDOW_FLOATS = ("acceptance_length", "draft_overhead", "speedup", "draft_ms", "verify_ms",
                  "error_rate", "ttft_p50", "ttft_p95", "ttft_p99", "tpot_p50", "tpot_p95",
                  "tpot_p99", "e2e_p50", "e2e_p95", "e2e_p99", "kv_peak")
WINDOW_STATS_FIELDS = (
    "ts", "bundle_id", "bucket", "cohort", "rounds", "drafted_tokens", "accepted_tokens",
    "acceptance_length", "draft_overhead", "speedup", "draft_ms", "verify_ms", "requests",
    "errors", "error_rate", "ttft_p50", "ttft_p95", "ttft_p99", "tpot_p50", "tpot_p95",
    "tpot_p99", "e2e_p50", "e2e_p95", "e2e_p99", "kv_peak", "shadow_checks",
    "shadow_mismatches", "speculation_on", "steps", "plain_entries", "accepted_at_least",
    "drafted_at_least",
)
"""The keys of one window-stats row, in table column order."""
# Columns added after the first release: an archive created before gets them on open.
_WINDOW_ADDED = ("steps", "plain_entries", "accepted_at_least", "drafted_at_least")

_FLOAT_SET = frozenset(_WINDOW_FLOATS)
_WINDOW_FIELD_SET = frozenset(WINDOW_STATS_FIELDS)
_WINDOW_TEXT = ("bundle_id", "bucket", "cohort")
# Every number (counts and the flag too) is unpacked as float64 first, so None, NaN,
# fractions and negatives can be told apart and refused or kept as the field needs.
_WINDOW_NUMBERS = tuple(name for name in WINDOW_STATS_FIELDS if name not in _WINDOW_TEXT + _WINDOW_ARRAYS)
_WINDOW_NUMBER_VALUES = operator.itemgetter(*_WINDOW_NUMBERS)
_WINDOW_EXPECTED = {name: "a count" if name in _WINDOW_COUNTS else "a number or NaN"
                    for name in WINDOW_STATS_FIELDS}
_WINDOW_EXPECTED.update(ts="a finite slice end time", bundle_id="a bundle id string",
                        bucket="a string or None", cohort="a string or None",
                        speculation_on="a bool", accepted_at_least="a list of counts",
                        drafted_at_least="a list of counts")


def _window_column_type(name: str) -> str:
    """The ClickHouse type of one window-stats column."""
    if name == "ts":
        return "Float64"
    if name == "bundle_id":
        return "LowCardinality(String)"
    if name in _WINDOW_TEXT:
        return "LowCardinality(Nullable(String))"
    if name == "speculation_on":
        return "Bool"
    if name in _WINDOW_ARRAYS:
        return "Array(UInt64)"
    return "UInt64" if name in _WINDOW_COUNTS else "Nullable(Float64)"

# Scope columns (bucket, cohort) are Nullable because NULL means "every bucket/cohort"
# in decisions; the same convention holds in every table, so sorting keys that contain
# them need allow_nullable_key.
_TABLES: dict[str, str] = {
    "decisions": """
        decision_id String,
        ts Float64,
        bundle_id LowCardinality(String),
        bucket LowCardinality(Nullable(String)),
        cohort LowCardinality(Nullable(String)),
        action LowCardinality(String),
        reason LowCardinality(String),
        detector LowCardinality(String),
        evidence String,
        sample_ids Array(String),
        line String,
        archived_at DateTime64(6, 'UTC') DEFAULT now64(6)
    ) ENGINE = ReplacingMergeTree
    ORDER BY (bundle_id, decision_id)""",
    "audit": """
        audit_id String,
        ts Float64,
        kind LowCardinality(String),
        actor String,
        decision_id Nullable(String),
        bundle_id LowCardinality(String),
        scope String,
        reason String,
        detector String,
        thresholds String,
        baseline String,
        window String,
        card String,
        detail String,
        archived_at DateTime64(6, 'UTC') DEFAULT now64(6)
    ) ENGINE = ReplacingMergeTree
    ORDER BY audit_id""",
    "samples": """
        decision_id String,
        kind LowCardinality(String),
        sample_id String,
        ts Float64,
        bundle_id LowCardinality(String),
        bucket LowCardinality(Nullable(String)),
        cohort LowCardinality(Nullable(String)),
        worker LowCardinality(Nullable(String)),
        record String
    ) ENGINE = ReplacingMergeTree
    ORDER BY (decision_id, kind, sample_id)""",
    "window_stats": """
        """ + ",\n        ".join(f"{name} {_window_column_type(name)}" for name in WINDOW_STATS_FIELDS) + """
    ) ENGINE = ReplacingMergeTree
    PARTITION BY toYYYYMM(toDateTime(toUInt32(ts), 'UTC'))
    ORDER BY (bundle_id, bucket, cohort, ts)
    SETTINGS allow_nullable_key = 1""",
    "bundles": """
        bundle_id String,
        card SimpleAggregateFunction(any, String),
        first_seen SimpleAggregateFunction(min, Float64),
        last_seen SimpleAggregateFunction(max, Float64),
        workers SimpleAggregateFunction(groupUniqArrayArray, Array(String))
    ) ENGINE = AggregatingMergeTree
    ORDER BY bundle_id""",
    # Every worker's span of running a bundle; rewritten as it grows (min/max keep it whole).
    "bundle_sightings": """
        bundle_id String,
        worker String,
        first_seen SimpleAggregateFunction(min, Float64),
        last_seen SimpleAggregateFunction(max, Float64)
    ) ENGINE = AggregatingMergeTree
    ORDER BY (bundle_id, worker)""",
    "overrides": """
        override_id String,
        ts Float64,
        bundle_id LowCardinality(String),
        bucket LowCardinality(Nullable(String)),
        cohort LowCardinality(Nullable(String)),
        enabled Bool,
        draft_limit Nullable(UInt16),
        by String,
        reason String,
        cleared Bool,
        archived_at DateTime64(6, 'UTC') DEFAULT now64(6)
    ) ENGINE = ReplacingMergeTree
    ORDER BY override_id""",
    "bundle_stages": """
        change_id String,
        ts Float64,
        bundle_id LowCardinality(String),
        stage LowCardinality(String),
        previous_stage LowCardinality(Nullable(String)),
        cohort_share Float64,
        actor String,
        reason String,
        decision_id Nullable(String),
        detail String,
        seq UInt32,
        archived_at DateTime64(6, 'UTC') DEFAULT now64(6)
    ) ENGINE = ReplacingMergeTree
    ORDER BY (bundle_id, change_id)""",
    "rejections": """
        ts Float64,
        source LowCardinality(String),
        reason LowCardinality(String),
        count UInt64
    ) ENGINE = ReplacingMergeTree
    ORDER BY (source, reason, ts)""",
}

_STR = pa.string()
_F64 = pa.float64()
_DECISION_SCHEMA = pa.schema([
    ("decision_id", _STR), ("ts", _F64), ("bundle_id", _STR), ("bucket", _STR), ("cohort", _STR),
    ("action", _STR), ("reason", _STR), ("detector", _STR), ("evidence", _STR),
    ("sample_ids", pa.list_(_STR)), ("line", _STR),
])
_AUDIT_SCHEMA = pa.schema([
    ("audit_id", _STR), ("ts", _F64), ("kind", _STR), ("actor", _STR), ("decision_id", _STR),
    ("bundle_id", _STR), ("scope", _STR), ("reason", _STR), ("detector", _STR),
    ("thresholds", _STR), ("baseline", _STR), ("window", _STR), ("card", _STR), ("detail", _STR),
])
_SAMPLE_SCHEMA = pa.schema([
    ("decision_id", _STR), ("kind", _STR), ("sample_id", _STR), ("ts", _F64), ("bundle_id", _STR),
    ("bucket", _STR), ("cohort", _STR), ("worker", _STR), ("record", _STR),
])
_BUNDLE_SCHEMA = pa.schema([
    ("bundle_id", _STR), ("card", _STR), ("first_seen", _F64), ("last_seen", _F64),
    ("workers", pa.list_(_STR)),
])
_SIGHTING_SCHEMA = pa.schema([
    ("bundle_id", _STR), ("worker", _STR), ("first_seen", _F64), ("last_seen", _F64),
])
_OVERRIDE_SCHEMA = pa.schema([
    ("override_id", _STR), ("ts", _F64), ("bundle_id", _STR), ("bucket", _STR), ("cohort", _STR),
    ("enabled", pa.bool_()), ("draft_limit", pa.uint16()), ("by", _STR), ("reason", _STR),
    ("cleared", pa.bool_()),
])
_STAGE_SCHEMA = pa.schema([
    ("change_id", _STR), ("ts", _F64), ("bundle_id", _STR), ("stage", _STR), ("previous_stage", _STR),
    ("cohort_share", _F64), ("actor", _STR), ("reason", _STR), ("decision_id", _STR), ("detail", _STR),
    ("seq", pa.uint32()),
])
# Who makes stage changes that are not a person's: the admission controller and the policy file.
_AUTOMATIC_ACTORS = ("specwatch", "policy")
_REJECTION_SCHEMA = pa.schema([
    ("ts", _F64), ("source", _STR), ("reason", _STR), ("count", pa.uint64()),
])
_DECISION_COLUMNS = ", ".join(_DECISION_SCHEMA.names)

# Sealed samples (key id and ciphertext, never clear text) and `specwatch reproduce` results.
# Each column list is written once and gives both the table and its insert schema.
_SEALED_COLUMNS = (("decision_id", "String"), ("sample_id", "String"), ("ts", "Float64"),
                   ("bundle_id", "LowCardinality(String)"), ("key_id", "LowCardinality(String)"),
                   ("prompt_sha256", "String"), ("output_sha256", "String"), ("sealed", "String"))
_REPRODUCTION_COLUMNS = (("reproduction_id", "String"), ("decision_id", "String"), ("ts", "Float64"),
                         ("actor", "String"), ("verdict", "LowCardinality(String)"), ("result", "String"))
_SEALED_RETENTION_ENV = "SPECWATCH_SEALED_SAMPLE_DAYS"
# Sealed token ids are kept this long after they were archived, then ClickHouse drops them
# (a TTL on the table); the hashes in `samples` stay with the decision.
_DEFAULT_SEALED_RETENTION_DAYS = 30


def _column_table(columns: Sequence[tuple[str, str]], tail: str) -> str:
    return ",\n        ".join(f"{name} {kind}" for name, kind in columns) + ",\n        " + tail


def _column_schema(columns: Sequence[tuple[str, str]]) -> pa.Schema:
    return pa.schema([(name, _F64 if kind == "Float64" else _STR) for name, kind in columns])


_TABLES["sealed_samples"] = _column_table(_SEALED_COLUMNS, f"""archived_at DateTime DEFAULT now()
    ) ENGINE = ReplacingMergeTree
    ORDER BY (decision_id, sample_id)
    TTL archived_at + INTERVAL {_DEFAULT_SEALED_RETENTION_DAYS} DAY""")
_TABLES["reproductions"] = _column_table(_REPRODUCTION_COLUMNS, """archived_at DateTime64(6, 'UTC') DEFAULT now64(6)
    ) ENGINE = ReplacingMergeTree
    ORDER BY (decision_id, reproduction_id)""")
_SEALED_SCHEMA = _column_schema(_SEALED_COLUMNS)
_REPRODUCTION_SCHEMA = _column_schema(_REPRODUCTION_COLUMNS)
_AUDIT_JSON = ("thresholds", "baseline", "window", "card", "detail")


class ArchiveError(RuntimeError):
    """The archive cannot be opened or used as asked."""


class ArchiveNotFoundError(ArchiveError):
    """No archive at that DSN (and the caller did not ask to create one)."""


class ArchiveQueryLimit(ArchiveError):
    """An ad-hoc query hit one of its limits: ``setting`` (``max_execution_time`` or
    ``max_result_rows``) at ``limit``."""

    def __init__(self, setting: str, limit: float) -> None:
        what = f"ran longer than {limit:g} s" if setting == "max_execution_time" else f"returns more than {limit:g} rows"
        super().__init__(f"query stopped: it {what} ({setting})")
        self.setting = setting
        self.limit = limit


def archive_dsn(environ: Mapping[str, str] | None = None) -> str:
    """The archive DSN to use when none is given: ``$SPECWATCH_ARCHIVE`` or the default.

    >>> archive_dsn({})
    'chdb://specwatch-data/archive'
    >>> archive_dsn({"SPECWATCH_ARCHIVE": "chdb:///var/lib/specwatch"})
    'chdb:///var/lib/specwatch'
    """
    environ = os.environ if environ is None else environ
    return environ.get(ARCHIVE_ENV) or DEFAULT_ARCHIVE_DSN


# -- where the archive lives -----------------------------------------------------------

@dataclass(frozen=True)
class _Location:
    """A parsed archive DSN. Holds no password: that goes straight to the client."""

    engine: str  # "chdb" or "server"
    path: str = ""
    host: str = ""
    port: int = 0
    secure: bool = False
    database: str = _DEFAULT_DATABASE
    username: str = ""

    @property
    def label(self) -> str:
        """The DSN as it may appear in logs and messages (never with credentials)."""
        if self.engine == "chdb":
            return f"chdb://{self.path}"
        scheme = "https" if self.secure else "http"
        return f"{scheme}://{self.host}:{self.port}/{self.database}"


def _parse_dsn(dsn: str, cwd: str | None = None) -> tuple[_Location, str | None]:
    """Split an archive DSN into a location and the password it carries, if any.

    >>> _parse_dsn("chdb://specwatch-data/archive", cwd="/srv")[0].path
    '/srv/specwatch-data/archive'
    >>> _parse_dsn("chdb:///var/lib/specwatch")[0].path
    '/var/lib/specwatch'
    >>> loc, password = _parse_dsn("https://ops:s%40cret@ch.internal:8443/postmortems")
    >>> loc.label, loc.username, password
    ('https://ch.internal:8443/postmortems', 'ops', 's@cret')
    >>> _parse_dsn("http://ch.internal")[0].label
    'http://ch.internal:8123/specwatch'
    """
    scheme, sep, rest = dsn.partition("://")
    scheme = scheme.lower()
    if not sep or not rest:
        raise ValueError(f"archive DSN {_redact(dsn)!r} is not chdb:///abs/path, chdb://relative/path "
                         "or http(s)://[user[:password]@]host[:port][/database]")
    if scheme == "chdb":
        # chdb:///abs is absolute; chdb://rel/dir is relative to the working directory
        # (clickhouse-connect alone would read the first segment as a location and the
        # rest as a database name).
        raw = unquote(rest.split("?", 1)[0])
        path = raw if raw.startswith("/") else os.path.join(cwd or os.getcwd(), raw)
        return _Location("chdb", path=os.path.normpath(path)), None
    if scheme not in ("http", "https"):
        raise ValueError(f"archive DSN scheme {scheme!r} is not one of chdb, http, https")
    try:
        parts = urlsplit(dsn)
        parts.port  # noqa: B018 - parsed lazily; a port that is not a number raises here
    except ValueError as error:  # "Invalid IPv6 URL", "Port out of range 0-65535"
        raise ValueError(f"archive DSN {_redact(dsn)!r} is not a URL ({error})") from None
    if not parts.hostname:
        raise ValueError(f"archive DSN {_redact(dsn)!r} has no host")
    secure = scheme == "https"
    database = unquote(parts.path.strip("/")) or _DEFAULT_DATABASE
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", database):
        raise ValueError(f"archive database name {database!r} must be a plain identifier")
    location = _Location("server", host=parts.hostname, port=parts.port or (8443 if secure else 8123),
                         secure=secure, database=database, username=unquote(parts.username or ""))
    return location, unquote(parts.password) if parts.password is not None else None


def check_archive_dsn(dsn: str) -> str:
    """``dsn`` as it may be shown (no password) if it names an archive; ValueError saying why not.

    Nothing is opened or created: commands call this before they start any work.

    >>> check_archive_dsn("http://ops:hunter2@ch:8123/db")
    'http://ch:8123/db'
    >>> check_archive_dsn("https://[::1")
    Traceback (most recent call last):
    ...
    ValueError: archive DSN 'https://[::1' is not a URL (Invalid IPv6 URL)
    """
    return _parse_dsn(dsn)[0].label


def _redact(dsn: str) -> str:
    """A DSN with any password removed, for error messages.

    >>> _redact("http://ops:hunter2@ch:8123/db")
    'http://ops:***@ch:8123/db'
    """
    return re.sub(r"(://[^:/@]*):[^@/]*@", r"\1:***@", dsn)


class _ChdbClients:
    """The per-process cache of chDB clients.

    chDB hosts one engine path per process, so every archive opened on that path in
    this process shares one client; the engine is released when the last one closes,
    after which another path may be opened.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._path: str | None = None
        self._client: Any = None
        self._users = 0

    def acquire(self, path: str) -> Any:
        path = os.path.realpath(path)
        with self._lock:
            if self._client is not None:
                if path != self._path:
                    raise ArchiveError(
                        f"chDB hosts one archive per process: {self._path} is open here, so "
                        f"{path} cannot be; close the other archive or use another process")
                self._users += 1
                return self._client
            import clickhouse_connect  # heavy; only archive users pay for it

            # Both asked first: the engine would print its own error straight to stderr.
            holder = _chdb_holder(path)
            if holder:
                raise ArchiveError(_in_use(path, holder))
            try:
                os.close(os.open(os.path.join(path, "status"), os.O_WRONLY | os.O_CREAT, 0o644))
            except OSError as exc:
                raise ArchiveError(f"the chDB archive at {path} cannot be written: "
                                   f"{exc.strerror or exc} ({exc.filename})") from exc
            try:
                client = clickhouse_connect.get_client(interface="chdb", path=path)
            except Exception as exc:
                holder = _chdb_holder(path)
                if holder:
                    # chDB's own message here is an empty "Error initializing EmbeddedServer".
                    raise ArchiveError(_in_use(path, holder)) from exc
                raise ArchiveError(f"cannot open the chDB archive at {path}: {exc}") from exc
            self._path, self._client, self._users = path, client, 1
            return client

    def release(self, client: Any) -> None:
        with self._lock:
            if client is not self._client:
                return
            self._users -= 1
            if self._users == 0:
                self._client, self._path = None, None
                client.close()


def _in_use(path: str, holder: str) -> str:
    return (f"the chDB archive at {path} is in use by process {holder}: a chDB directory opens in one "
            "process at a time (use a ClickHouse server DSN to read while the pipeline writes)")


def _chdb_holder(path: str) -> str | None:
    """The pid of another running engine that holds the directory's lock file, if any."""
    try:
        with open(os.path.join(path, "status"), encoding="utf-8", errors="replace") as status:
            text = status.read(4096)
            try:  # the engine holds an exclusive flock on it while it runs
                fcntl.flock(status.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(status.fileno(), fcntl.LOCK_UN)
                return None
            except BlockingIOError:
                pass
            except OSError:
                pass  # no flock here: the pid alone has to tell
    except OSError:
        return None
    found = re.search(r"PID:\s*(\d+)", text)
    if not found or int(found.group(1)) == os.getpid():
        return None
    try:
        os.kill(int(found.group(1)), 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return None  # a stale file left by an engine that crashed
    except PermissionError:
        pass
    return found.group(1)


# The one piece of module-level mutable state: chDB's one-engine-per-process rule
# makes the engine a process resource, so its clients are shared per process.
_CHDB_CLIENTS = _ChdbClients()


# -- the archive -----------------------------------------------------------------------

class Archive:
    """Decisions, audit rows, samples, window stats, bundles and overrides in ClickHouse.

    Parameters
    ----------
    client
        A clickhouse-connect client (chDB or server); the caller keeps owning it.
    database
        Database holding the archive tables.
    sample_text
        How free text in samples is kept: ``"hashes"`` (a digest, the default) or
        ``"redacted"`` (quoted spans and long numbers removed); see `specwatch.schemas.redaction`.

    Writes are idempotent: rows carry stable ids, tables are ReplacingMergeTree, and
    reads use FINAL, so writing the same decision twice leaves one.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as tmp, Archive.open(f"chdb://{tmp}/a") as archive:
    ...     d = Decision(ts=10.0, bundle_id="b-1", bucket="coding", action="disable_speculation",
    ...                  reason="acceptance_drop", detector="al_gate")
    ...     archive.write_decision(d, {"thresholds": {"al_min": 1.8}}, [])
    ...     archive.write_decision(d, {"thresholds": {"al_min": 1.8}}, [])
    ...     [(r["decision_id"], r["action"]) for r in archive.decisions(bundle_id="b-1")]
    ...     archive.flag_store().lookup("b-1", "coding", "main").enabled
    [('d-...', 'disable_speculation')]
    False
    """

    def __init__(self, client: Any, database: str = _DEFAULT_DATABASE,
                 sample_text: str = _DEFAULT_SAMPLE_TEXT) -> None:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", database):
            raise ValueError(f"archive database name {database!r} must be a plain identifier")
        if sample_text not in SAMPLE_TEXT_MODES:
            raise ValueError(f"sample_text must be one of {', '.join(SAMPLE_TEXT_MODES)}, got {sample_text!r}")
        self.sample_text = sample_text
        self.sealed_retention_days = _DEFAULT_SEALED_RETENTION_DAYS
        self._client = client
        self._db = database
        self._label = f"{type(client).__name__}/{database}"
        self._release: Callable[[], None] | None = None
        self._lock = threading.Lock()

    @classmethod
    def open(cls, dsn: str | None = None, *, create: bool = True,
             environ: Mapping[str, str] | None = None, sample_text: str | None = None) -> "Archive":
        """Open the archive at `dsn` (default: `archive_dsn()`), creating it if asked.

        ``chdb:///abs/path`` or ``chdb://relative/path`` is an embedded chDB directory;
        ``http(s)://user:pass@host:port/db`` a ClickHouse server, with credentials from
        ``$SPECWATCH_CLICKHOUSE_USER``/``_PASSWORD`` when the DSN has none. With
        ``create=False`` a missing archive raises `ArchiveNotFoundError`. ``sample_text``
        defaults to ``$SPECWATCH_ARCHIVE_SAMPLE_TEXT`` or ``"hashes"``.
        """
        environ = os.environ if environ is None else environ
        sample_text = sample_text or environ.get(_SAMPLE_TEXT_ENV) or _DEFAULT_SAMPLE_TEXT
        if sample_text not in SAMPLE_TEXT_MODES:
            raise ValueError(f"{_SAMPLE_TEXT_ENV} must be one of {', '.join(SAMPLE_TEXT_MODES)}, "
                             f"got {sample_text!r}")
        retention_days = _retention_days(environ)
        location, password = _parse_dsn(dsn or archive_dsn(environ))
        if location.engine == "chdb":
            # Checked before the engine starts: opening a directory makes chDB lay out
            # its store there, which a read-only command must not do to a wrong path.
            if not create and not os.path.isdir(os.path.join(location.path, "metadata")):
                raise ArchiveNotFoundError(f"no archive at {location.label}")
            if create:
                os.makedirs(location.path, exist_ok=True)
            client = _CHDB_CLIENTS.acquire(location.path)
            release = functools.partial(_CHDB_CLIENTS.release, client)
        else:
            import clickhouse_connect

            username = location.username or environ.get(_USER_ENV) or "default"
            if password is None:
                password = environ.get(_PASSWORD_ENV, "")
            try:
                client = clickhouse_connect.get_client(
                    host=location.host, port=location.port, username=username, password=password,
                    secure=location.secure)
            except Exception as exc:
                # The driver's message names host and user, never the password; the socket's own
                # reason ("[Errno 111] Connection refused") says it in one line when it is there.
                reason = re.search(r"\[Errno -?\d+\][^'\")]*", str(exc))
                raise ArchiveError(f"cannot connect to the archive at {location.label}: "
                                   f"{reason.group(0).strip() if reason else exc}") from exc
            release = client.close
        archive = cls(client, location.database, sample_text)
        archive.sealed_retention_days = retention_days
        archive._label = location.label
        archive._release = release
        try:
            if create:
                archive.ensure_schema()
            elif not archive.exists():
                raise ArchiveNotFoundError(f"no archive at {location.label}")
        except BaseException:
            archive.close()
            raise
        logger.debug("archive open at %s", location.label)
        return archive

    def __repr__(self) -> str:
        return f"Archive({self._label!r})"

    @property
    def label(self) -> str:
        """Where this archive is, as it may appear in logs (never with credentials)."""
        return self._label

    def __enter__(self) -> "Archive":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the client if this archive opened it; a passed-in client stays open."""
        release, self._release = self._release, None
        if release is not None:
            release()

    # -- schema ------------------------------------------------------------------------
    def ensure_schema(self) -> None:
        """Create the database and every table if missing; safe to call at every start."""
        self._client.command(f"CREATE DATABASE IF NOT EXISTS {self._db}")
        for table, body in _TABLES.items():
            self._client.command(f"CREATE TABLE IF NOT EXISTS {self._db}.{table} ({body}")
        for name in _WINDOW_ADDED:
            self._client.command(f"ALTER TABLE {self._db}.window_stats ADD COLUMN IF NOT EXISTS "
                                 f"{name} {_window_column_type(name)}")
        self._apply_sealed_retention()

    def _apply_sealed_retention(self) -> None:
        # The TTL is part of the table: changed in place when the setting differs from it.
        ttl = f"toIntervalDay({int(self.sealed_retention_days)})"
        rows = self._select("SELECT engine_full FROM system.tables WHERE database = {db:String} "
                            "AND name = 'sealed_samples'", {"db": self._db})
        if rows and ttl not in rows[0]["engine_full"]:
            self._client.command(f"ALTER TABLE {self._db}.sealed_samples MODIFY TTL "
                                 f"archived_at + INTERVAL {int(self.sealed_retention_days)} DAY")

    def exists(self) -> bool:
        """Whether the archive tables are there (an archive was created at this place)."""
        result = self._client.query(f"EXISTS TABLE {self._db}.decisions")
        return bool(result.result_rows and result.result_rows[0][0])

    # -- writes ------------------------------------------------------------------------
    def write_decision(self, decision: Decision, audit: Mapping[str, Any] | None,
                       samples: Sequence[Mapping[str, Any]] = ()) -> None:
        """Archive one decision with its audit row and reproducible samples.

        ``audit`` holds ``thresholds``, ``baseline``, ``window`` (per-slice stats) and
        ``card``; other keys land in the audit row's ``detail``. Each sample is a
        contract-v1 request, step or shadow record dict.
        """
        self.write_decisions([(decision, audit, samples)])

    def write_decisions(self, items: Iterable[tuple[Decision, Mapping[str, Any] | None,
                                                    Sequence[Mapping[str, Any]]]]) -> int:
        """Archive many decisions in one insert per table; returns how many."""
        batch = _DecisionBatch(self.sample_text)
        for decision, audit, samples in items:
            batch.add(decision, audit, samples)
        return self._write_decision_batch(batch)

    def write_window_stats(self, rows: Sequence[Mapping[str, Any]]) -> int:
        """Archive window-stats rows (keys: `WINDOW_STATS_FIELDS`); returns how many.

        One row per (slice end ``ts``, bundle, bucket, cohort); writing the same slice
        again replaces it. NaN floats are stored as NULL and read back as NaN. Big
        batches go in chunks; a bad row raises ValueError naming it, and stops the
        write at its chunk (rewriting the chunks before it is harmless).
        """
        rows = rows if isinstance(rows, list) else list(rows)
        starts = range(0, len(rows), _DEFAULT_INSERT_CHUNK_ROWS)
        if len(starts) <= 1:
            if rows:
                self._insert_table("window_stats", _window_stats_table(rows, 0))
            return len(rows)
        # The engine releases the GIL while it inserts, so converting the next chunk
        # overlaps with inserting this one whenever a second core is free.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="specwatch-archive") as inserter:
            pending = None
            for start in starts:
                table = _window_stats_table(rows[start:start + _DEFAULT_INSERT_CHUNK_ROWS], start)
                if pending is not None:
                    pending.result()
                pending = inserter.submit(self._insert_table, "window_stats", table)
            pending.result()
        return len(rows)

    def write_bundle(self, bundle_id: str, card: Mapping[str, Any] | Any, ts: float,
                     worker: str) -> None:
        """Record a bundle's card, seen on ``worker`` at ``ts`` (a sighting too)."""
        _require_text(bundle_id, "bundle_id")
        ts = _finite(ts, "ts")
        self._insert("bundles", _BUNDLE_SCHEMA,
                     [[bundle_id], [_json(card)], [ts], [ts], [[worker] if worker else []]])
        if worker:
            self.write_sightings([{"bundle_id": bundle_id, "worker": worker, "first_seen": ts, "last_seen": ts}])

    def write_sightings(self, sightings: Sequence[Mapping[str, Any]]) -> int:
        """Record spans of workers running bundles (``bundle_id``, ``worker``, ``first_seen``,
        ``last_seen``); returns how many. A span written again, or grown, keeps its earliest
        first and latest last sighting."""
        columns: list[list[Any]] = [[], [], [], []]
        for row in sightings:
            _require_text(row["bundle_id"], "bundle_id")
            _require_text(row["worker"], "worker")
            first, last = _finite(row["first_seen"], "first_seen"), _finite(row["last_seen"], "last_seen")
            if first > last:
                raise ValueError(f"sighting of {row['bundle_id']} on {row['worker']}: first_seen {first} "
                                 f"is after last_seen {last}")
            _append(columns, (row["bundle_id"], row["worker"], first, last))
        if columns[0]:
            self._insert("bundle_sightings", _SIGHTING_SCHEMA, columns)
        return len(columns[0])

    def write_override(self, scope: tuple[str, str | None, str | None], enabled: bool,
                       draft_limit: int | None, by: str, reason: str, ts: float,
                       cleared: bool = False) -> str:
        """Record a manual override (or its clearing) and its audit row; returns its id."""
        bundle_id, bucket, cohort = scope
        _require_text(bundle_id, "bundle_id")
        _require_text(by, "by (who made the override)")
        ts = _finite(ts, "ts")
        if draft_limit is not None and not (isinstance(draft_limit, int) and 1 <= draft_limit <= 64):
            raise ValueError(f"draft_limit must be an integer in 1..64, not {draft_limit!r}")
        body = {"bundle_id": bundle_id, "bucket": bucket, "cohort": cohort, "enabled": bool(enabled),
                "draft_limit": draft_limit, "by": by, "reason": reason, "ts": ts, "cleared": bool(cleared)}
        override_id = "o-" + hashlib.sha256(_json(body).encode()).hexdigest()[:16]
        audit = [f"a-{override_id}", ts, "override_clear" if cleared else "override", by, None,
                 bundle_id, decision_key(bundle_id, bucket, cohort), reason, "", "null", "null",
                 "null", "null",
                 "null" if cleared else _json({"enabled": bool(enabled), "draft_limit": draft_limit})]
        self._insert("overrides", _OVERRIDE_SCHEMA,
                     [[v] for v in (override_id, ts, bundle_id, bucket, cohort, bool(enabled),
                                    draft_limit, by, reason, bool(cleared))])
        self._insert("audit", _AUDIT_SCHEMA, [[v] for v in audit])
        return override_id

    def write_stage_changes(self, changes: Iterable[Any]) -> int:
        """Record admission stage changes (`StageChange`s or their dicts) in the bundle registry.

        Automatic changes name the decision that made them; its audit row holds the evidence.
        """
        rows = [_stage_row(c if isinstance(c, Mapping) else vars(c)) for c in changes]
        if rows:
            self._insert("bundle_stages", _STAGE_SCHEMA, [list(col) for col in zip(*rows)])
        return len(rows)

    def write_manual_stage(self, bundle_id: str, stage: str, by: str, reason: str, ts: float,
                           previous_stage: str | None = None, cohort_share: float = 0.0,
                           cohort: str | None = None) -> str:
        """Record a stage a person put a bundle in, with its audit row; returns the change id."""
        from specwatch.actions.flags import STAGES

        _require_text(bundle_id, "bundle_id")
        _require_text(by, "by (who made the change)")
        if by in _AUTOMATIC_ACTORS:
            raise ValueError(f"{by!r} names automatic changes; give the name of the person making this one")
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; choose one of {', '.join(STAGES)}")
        ts = _finite(ts, "ts")
        change = {"bundle_id": bundle_id, "ts": ts, "stage": stage, "previous_stage": previous_stage,
                  "cohort_share": float(cohort_share), "actor": by, "reason": reason, "decision_id": None,
                  "detail": {"manual": True, "cohort": cohort}, "seq": len(self.stage_history(bundle_id))}
        row = _stage_row(change)
        self._insert("bundle_stages", _STAGE_SCHEMA, [[v] for v in row])
        audit = [f"a-{row[0]}", ts, "stage_change", by, None, bundle_id, decision_key(bundle_id, None, None),
                 reason, "", "null", "null", "null", "null",
                 _json({"stage": stage, "previous_stage": previous_stage, "cohort_share": float(cohort_share),
                        "cohort": cohort})]
        self._insert("audit", _AUDIT_SCHEMA, [[v] for v in audit])
        return row[0]

    def write_rejections(self, counts: Mapping[str, int], ts: float, source: str) -> None:
        """Record rejected-record counts by reason, as of `ts`, for one source."""
        _require_text(source, "source")
        ts = _finite(ts, "ts")
        reasons = sorted(counts)
        if reasons:
            self._insert("rejections", _REJECTION_SCHEMA,
                         [[ts] * len(reasons), [source] * len(reasons), reasons,
                          [int(counts[r]) for r in reasons]])

    # -- reads -------------------------------------------------------------------------
    def decisions(self, bundle_id: str | None = None, bucket: str | None = None,
                  reason: str | None = None, action: str | None = None,
                  since: float | None = None, until: float | None = None,
                  limit: int | None = _DEFAULT_DECISIONS_LIMIT) -> list[dict]:
        """The most recent `limit` matching decisions, oldest first.

        ``bucket="*"`` selects whole-bundle decisions; ``since``/``until`` are
        inclusive unix seconds; ``limit=None`` returns every match.
        """
        where, params = _filters(bundle_id=bundle_id, bucket=bucket, reason=reason, action=action,
                                 since=since, until=until)
        sql = (f"SELECT {_DECISION_COLUMNS} FROM {self._db}.decisions FINAL{where} "
               "ORDER BY ts DESC, archived_at DESC, decision_id DESC")
        if limit is not None:
            if limit < 0:
                raise ValueError(f"limit must be >= 0 (or None for every match), not {limit}")
            sql += f" LIMIT {int(limit)}"
        rows = [_decision_out(r) for r in self._select(sql, params)]
        rows.reverse()
        return rows

    def decision(self, decision_id: str) -> dict | None:
        """One decision with its audit row (JSON fields parsed) under ``"audit"``."""
        rows = self._select(f"SELECT {_DECISION_COLUMNS} FROM {self._db}.decisions FINAL "
                            "WHERE decision_id = {id:String} LIMIT 1", {"id": decision_id})
        if not rows:
            return None
        out = _decision_out(rows[0])
        audit = self._select(f"SELECT * EXCEPT archived_at FROM {self._db}.audit FINAL "
                             "WHERE audit_id = {id:String} LIMIT 1", {"id": f"a-{decision_id}"})
        out["audit"] = _audit_out(audit[0]) if audit else None
        return out

    def samples(self, decision_id: str) -> list[dict]:
        """The samples archived with a decision, ``record`` parsed back to a dict."""
        rows = self._select(f"SELECT * FROM {self._db}.samples FINAL "
                            "WHERE decision_id = {id:String} ORDER BY ts, kind, sample_id",
                            {"id": decision_id})
        for row in rows:
            row["record"] = json.loads(row["record"])
        return rows

    def sealed_samples(self, decision_id: str) -> list[dict]:
        """The sealed samples of a decision: key id, digests and ciphertext (nothing is opened here)."""
        names = ", ".join(name for name, _ in _SEALED_COLUMNS)
        return self._select(f"SELECT {names} FROM {self._db}.sealed_samples FINAL "
                            "WHERE decision_id = {id:String} ORDER BY ts, sample_id", {"id": decision_id})

    def write_sample_opening(self, decision_id: str, bundle_id: str, actor: str, ts: float,
                             detail: Mapping[str, Any]) -> str:
        """Audit one attempt to open a decision's sealed samples (who, when, which, outcome)."""
        _require_text(actor, "actor (who opens the samples)")
        ts = _finite(ts, "ts")
        body = _json({"decision_id": decision_id, "actor": actor, "ts": ts, "detail": detail})
        audit_id = "a-open-" + hashlib.sha256(body.encode()).hexdigest()[:16]
        row = [audit_id, ts, "sample_open", actor, decision_id, bundle_id, "", "", "", "null", "null",
               "null", "null", _json(detail)]
        self._insert("audit", _AUDIT_SCHEMA, [[v] for v in row])
        return audit_id

    def write_reproduction(self, decision_id: str, actor: str, ts: float, verdict: str,
                           result: Mapping[str, Any]) -> str:
        """Archive a `specwatch reproduce` result beside its decision; returns its id."""
        _require_text(actor, "actor")
        ts = _finite(ts, "ts")
        text = _json(result)
        reproduction_id = "r-" + hashlib.sha256(f"{decision_id}\0{actor}\0{ts!r}\0{text}".encode()).hexdigest()[:16]
        self._insert("reproductions", _REPRODUCTION_SCHEMA,
                     [[v] for v in (reproduction_id, decision_id, ts, actor, verdict, text)])
        return reproduction_id

    def reproductions(self, decision_id: str) -> list[dict]:
        """The `specwatch reproduce` results archived for a decision, oldest first, ``result`` parsed."""
        rows = self._select(f"SELECT * EXCEPT archived_at FROM {self._db}.reproductions FINAL "
                            "WHERE decision_id = {id:String} ORDER BY ts, reproduction_id", {"id": decision_id})
        for row in rows:
            row["result"] = json.loads(row["result"])
        return rows

    def timeline(self, bundle_id: str | None = None, bucket: str | None = None,
                 cohort: str | None = None, since: float | None = None,
                 until: float | None = None) -> list[dict]:
        """Window-stats rows in slice order (``bucket``/``cohort`` ``"*"`` = whole-bundle rows)."""
        where, params = _filters(bundle_id=bundle_id, bucket=bucket, cohort=cohort, since=since,
                                 until=until)
        present = {r["name"] for r in self._select(
            "SELECT name FROM system.columns WHERE database = {db:String} AND table = 'window_stats'",
            {"db": self._db})}
        # An archive opened read-only from before the added columns reads them as empty.
        columns = ", ".join(name if name in present else
                            f"{'emptyArrayUInt64()' if name in _WINDOW_ARRAYS else 'toUInt64(0)'} AS {name}"
                            for name in WINDOW_STATS_FIELDS)
        rows = self._select(f"SELECT {columns} FROM {self._db}.window_stats "
                            f"FINAL{where} ORDER BY ts, bundle_id, bucket, cohort", params)
        nan = math.nan
        for row in rows:
            for name in _WINDOW_FLOATS:
                if row[name] is None:
                    row[name] = nan
        return rows

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
        by_bundle: dict[str, dict] = {}
        for row in cards:
            row["card"] = json.loads(row["card"])
            row["sightings"] = []
            by_bundle[row["bundle_id"]] = row
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

    def stage_history(self, bundle_id: str | None = None) -> list[dict]:
        """Admission stage changes in time order (``detail`` parsed): what changed a stage, when, why."""
        where, params = _filters(bundle_id=bundle_id)
        rows = self._select(f"SELECT * EXCEPT archived_at FROM {self._db}.bundle_stages FINAL{where} "
                            "ORDER BY ts, seq, archived_at, change_id", params)
        for row in rows:
            row["detail"] = json.loads(row["detail"])
        return rows

    def bundle_registry(self) -> list[dict]:
        """Every bundle seen, with its current admission stage (None when admission never judged it).

        The stage is the latest change in the registry, a person's or specwatch's.
        """
        latest: dict[str, dict] = {}
        for change in self.stage_history():
            latest[change["bundle_id"]] = change
        rows = self.bundles()
        seen = {row["bundle_id"] for row in rows}
        rows += [{"bundle_id": b, "card": None, "first_seen": c["ts"], "last_seen": c["ts"], "workers": [],
                  "sightings": []}
                 for b, c in latest.items() if b not in seen]
        for row in rows:
            change = latest.get(row["bundle_id"])
            row.update(stage=change["stage"] if change else None,
                       cohort_share=change["cohort_share"] if change else None,
                       stage_since=change["ts"] if change else None,
                       stage_by=change["actor"] if change else None,
                       stage_reason=change["reason"] if change else None)
        return rows

    def overrides(self, active_only: bool = True) -> list[dict]:
        """Manual overrides in time order: the one in force per scope, or every event."""
        sql = (f"SELECT * EXCEPT archived_at FROM {self._db}.overrides FINAL "
               "ORDER BY ts, archived_at, override_id")
        if active_only:
            # The latest event per scope decides; a clearing event means none is active.
            sql = (f"SELECT * FROM (SELECT * EXCEPT archived_at FROM {self._db}.overrides FINAL "
                   "ORDER BY ts DESC, archived_at DESC, override_id DESC "
                   "LIMIT 1 BY bundle_id, bucket, cohort) WHERE NOT cleared ORDER BY ts, override_id")
        return self._select(sql)

    def audit(self, bundle_id: str | None = None, kind: str | None = None,
              since: float | None = None, until: float | None = None) -> list[dict]:
        """Audit rows in time order, JSON fields parsed."""
        where, params = _filters(bundle_id=bundle_id, kind=kind, since=since, until=until)
        rows = self._select(f"SELECT * EXCEPT archived_at FROM {self._db}.audit FINAL{where} "
                            "ORDER BY ts, archived_at, audit_id", params)
        return [_audit_out(r) for r in rows]

    def rejections(self, source: str | None = None) -> list[dict]:
        """Rejected-record counts in time order."""
        where, params = _filters(source=source)
        return self._select(f"SELECT ts, source, reason, count FROM {self._db}.rejections FINAL"
                            f"{where} ORDER BY ts, source, reason", params)

    def flag_store(self, overrides: bool = True) -> FlagStore:
        """A `FlagStore` rebuilt from every archived decision, plus active overrides."""
        store = FlagStore()
        for row in self._select(f"SELECT line FROM {self._db}.decisions FINAL "
                                "ORDER BY ts, archived_at, decision_id"):
            store.apply(Decision.model_validate_json(row["line"]))
        if overrides:
            for o in self.overrides(active_only=True):
                store.override((o["bundle_id"], o["bucket"], o["cohort"]), o["enabled"], o["by"],
                               o["reason"], o["ts"], o["draft_limit"])
            # A person's stage change holds until a later automatic one moves the bundle on.
            latest: dict[str, dict] = {}
            for change in self.stage_history():
                latest[change["bundle_id"]] = change
            for bundle_id, change in latest.items():
                if change["actor"] not in _AUTOMATIC_ACTORS:
                    store.set_stage(bundle_id, change["stage"], change["actor"], change["reason"], change["ts"],
                                    change["detail"].get("cohort"), change["cohort_share"])
        return store

    def sql(self, statement: str, max_seconds: float = DEFAULT_SQL_MAX_SECONDS,
            max_rows: int = DEFAULT_SQL_MAX_ROWS) -> tuple[list[str], list[tuple]]:
        """Run a read-only statement (SELECT, WITH, SHOW, DESCRIBE); returns (columns, rows).

        Names without a database resolve in the archive's database (``SHOW TABLES`` lists
        the archive's tables). Anything but a read raises ValueError before it reaches the
        engine, which runs it with ``readonly=1`` as well. The engine stops the statement
        after ``max_seconds`` or past ``max_rows`` result rows (`ArchiveQueryLimit`); any
        other engine error raises `ArchiveError`. An empty result may have no column names.
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
            with self._lock:
                current = getattr(self._client, "database", None)
                self._client.database = self._db
                try:
                    result = self._client.query(statement, settings=settings)
                finally:
                    self._client.database = current
        except ClickHouseError as exc:
            # The engine's first line says what is wrong; the rest is its stack trace.
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            code = re.search(r"Code: (\d+)", message)
            setting = _LIMIT_CODES.get(int(code.group(1))) if code else None
            if setting is not None:
                raise ArchiveQueryLimit(setting, limits[setting]) from exc
            raise ArchiveError(f"query failed: {message}") from exc
        return list(result.column_names), list(result.result_rows)

    # -- plumbing ----------------------------------------------------------------------
    def _insert(self, table: str, schema: pa.Schema, columns: list[list[Any]]) -> None:
        arrays = [pa.array(values, type=field.type) for values, field in zip(columns, schema)]
        self._insert_table(table, pa.Table.from_arrays(arrays, schema=schema))

    def _insert_table(self, table: str, data: pa.Table) -> None:
        with self._lock:
            self._client.insert_arrow(f"{self._db}.{table}", data, settings=_INSERT_SETTINGS)

    def _write_decision_batch(self, batch: "_DecisionBatch") -> int:
        if not batch.count:
            return 0
        # Samples and audit go first: a decision row present means its evidence is too.
        if batch.samples[0]:
            self._insert("samples", _SAMPLE_SCHEMA, batch.samples)
        if batch.sealed[0]:
            self._insert("sealed_samples", _SEALED_SCHEMA, batch.sealed)
        self._insert("audit", _AUDIT_SCHEMA, batch.audits)
        self._insert("decisions", _DECISION_SCHEMA, batch.decisions)
        return batch.count

    def _select(self, sql: str, parameters: Mapping[str, Any] | None = None) -> list[dict]:
        with self._lock:
            result = self._client.query(sql, parameters=dict(parameters or {}))
        names = result.column_names
        return [dict(zip(names, row)) for row in result.result_rows]


class ArchiveWriter:
    """Buffers window stats and decisions, and writes them in batches.

    Parameters
    ----------
    archive
        Where batches go.
    max_rows
        Buffered window-stats rows that trigger a flush.
    max_delay
        Seconds after the first buffered row that trigger a flush on the next write
        or `flush_if_due()` call (there is no timer thread: the caller's loop ticks).
    max_buffered
        Window-stats rows kept while flushes fail; past it the oldest are dropped
        and counted in `dropped_rows`. Decisions are never dropped.
    clock
        Monotonic clock, passed in so tests can drive time.

    Rows are checked and converted when written, so a bad row fails at its source
    and never poisons a later flush. Automatic flushes (on a write or `flush_if_due`)
    log a failure, keep the rows and retry after `max_delay`; `flush()` and `close()`
    raise it. Bundles, sightings, overrides and rejection counts are rare and go
    straight through. `flush()` writes window stats before decisions, so the slices
    around a decision are archived by the time the decision is.
    """

    def __init__(self, archive: Archive, *, max_rows: int = _DEFAULT_WRITER_MAX_ROWS,
                 max_delay: float = _DEFAULT_WRITER_MAX_DELAY_S,
                 max_buffered: int = _DEFAULT_WRITER_MAX_BUFFERED,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be at least 1, not {max_rows}")
        if max_delay < 0:
            raise ValueError(f"max_delay must be >= 0 seconds, not {max_delay}")
        if max_buffered < max_rows:
            raise ValueError(f"max_buffered ({max_buffered}) must be >= max_rows ({max_rows})")
        self.archive = archive
        self.max_rows = max_rows
        self.max_delay = max_delay
        self.max_buffered = max_buffered
        self.dropped_rows = 0
        self._clock = clock
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._stats: list[pa.Table] = []
        self._stats_rows = 0
        self._decisions = _DecisionBatch(self._sample_text())
        self._since: float | None = None
        self._retry_at: float | None = None
        self.last_error: Exception | None = None

    @property
    def pending(self) -> int:
        """Window-stats rows plus decisions waiting for the next flush."""
        with self._lock:
            return self._stats_rows + self._decisions.count

    def write_window_stats(self, rows: Sequence[Mapping[str, Any]]) -> None:
        rows = rows if isinstance(rows, list) else list(rows)
        if not rows:
            return
        tables = [_window_stats_table(rows[i:i + _DEFAULT_INSERT_CHUNK_ROWS], i)
                  for i in range(0, len(rows), _DEFAULT_INSERT_CHUNK_ROWS)]
        with self._lock:
            self._stats.extend(tables)
            self._stats_rows += len(rows)
            self._drop_overflow()
            self._mark()
        self.flush_if_due()

    def write_decision(self, decision: Decision, audit: Mapping[str, Any] | None,
                       samples: Sequence[Mapping[str, Any]] = ()) -> None:
        with self._lock:
            self._decisions.add(decision, audit, samples)
            self._mark()
        self.flush_if_due()

    def write_bundle(self, bundle_id: str, card: Mapping[str, Any] | Any, ts: float, worker: str) -> None:
        self.archive.write_bundle(bundle_id, card, ts, worker)

    def write_sightings(self, sightings: Sequence[Mapping[str, Any]]) -> int:
        return self.archive.write_sightings(sightings)

    def write_stage_changes(self, changes: Iterable[Any]) -> int:
        # Rare (a few per bundle): straight through, after the decisions they name.
        self.flush()
        return self.archive.write_stage_changes(changes)

    def write_override(self, scope: tuple[str, str | None, str | None], enabled: bool,
                       draft_limit: int | None, by: str, reason: str, ts: float,
                       cleared: bool = False) -> str:
        return self.archive.write_override(scope, enabled, draft_limit, by, reason, ts, cleared)

    def write_rejections(self, counts: Mapping[str, int], ts: float, source: str) -> None:
        self.archive.write_rejections(counts, ts, source)

    def flush_if_due(self) -> bool:
        """Flush if enough rows are buffered or the oldest waited `max_delay`.

        A failure here is logged and kept in `last_error`, never raised: an archive
        outage must not stop the pipeline that feeds it. Rows stay buffered and the
        next attempt waits `max_delay`.
        """
        with self._lock:
            now = self._clock()
            due = (self._stats_rows >= self.max_rows or (
                self._since is not None and now - self._since >= self.max_delay)) and (
                self._retry_at is None or now >= self._retry_at)
        if not due:
            return False
        try:
            self.flush()
        except Exception as exc:  # whatever the sink raised; flush() kept the rows
            with self._lock:
                self._retry_at = self._clock() + self.max_delay
            logger.warning("archive writer could not flush %d pending rows (next try in %.1fs): %s",
                           self.pending, self.max_delay, exc)
            return False
        return True

    def flush(self) -> int:
        """Write everything buffered; returns rows written. A failed batch stays buffered."""
        with self._flush_lock:
            with self._lock:
                stats, self._stats, self._stats_rows = self._stats, [], 0
                decisions, self._decisions = self._decisions, _DecisionBatch(self._sample_text())
                self._since = None
            written = 0
            try:
                if stats:
                    # Many small writes become one insert (one part on disk).
                    merged = pa.concat_tables(stats)
                    for start in range(0, merged.num_rows, _DEFAULT_INSERT_CHUNK_ROWS):
                        self.archive._insert_table(
                            "window_stats", merged.slice(start, _DEFAULT_INSERT_CHUNK_ROWS))
                    written += merged.num_rows
                    stats = []
                written += self.archive._write_decision_batch(decisions)
                decisions = _DecisionBatch(self._sample_text())
            except Exception as exc:
                self.last_error = exc
                raise
            finally:
                if stats or decisions.count:
                    with self._lock:
                        self._stats[:0] = stats
                        self._stats_rows += sum(t.num_rows for t in stats)
                        decisions.extend(self._decisions)
                        self._decisions = decisions
                        self._drop_overflow()
                        self._mark()
            self.last_error, self._retry_at = None, None
        if written:
            logger.debug("archive writer flushed %d rows", written)
        return written

    def close(self) -> None:
        """Flush what is left. The archive itself stays open (its owner closes it)."""
        self.flush()

    def __enter__(self) -> "ArchiveWriter":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _sample_text(self) -> str:
        return getattr(self.archive, "sample_text", _DEFAULT_SAMPLE_TEXT)

    def _mark(self) -> None:
        if self._since is None and (self._stats_rows or self._decisions.count):
            self._since = self._clock()

    def _drop_overflow(self) -> None:
        dropped = 0
        while self._stats_rows > self.max_buffered and len(self._stats) > 1:
            table = self._stats.pop(0)
            self._stats_rows -= table.num_rows
            dropped += table.num_rows
        if dropped:
            self.dropped_rows += dropped
            logger.warning("archive writer dropped %d oldest window-stats rows (%d in total) "
                           "while flushes fail", dropped, self.dropped_rows)


class _DecisionBatch:
    """Decisions, audit rows and samples encoded into insert columns."""

    def __init__(self, sample_text: str = _DEFAULT_SAMPLE_TEXT) -> None:
        self.sample_text = sample_text
        self.decisions: list[list[Any]] = [[] for _ in _DECISION_SCHEMA]
        self.audits: list[list[Any]] = [[] for _ in _AUDIT_SCHEMA]
        self.samples: list[list[Any]] = [[] for _ in _SAMPLE_SCHEMA]
        self.sealed: list[list[Any]] = [[] for _ in _SEALED_SCHEMA]
        self.count = 0

    def add(self, decision: Decision, audit: Mapping[str, Any] | None,
            samples: Sequence[Mapping[str, Any]]) -> None:
        if not isinstance(decision, Decision):
            raise TypeError(f"write_decision needs a Decision, not {type(decision).__name__}")
        # Everything is encoded before anything is kept, so a bad sample never leaves
        # a half-recorded decision behind.
        decision_id = decision.id  # a digest of the canonical line: computed once
        rows = _decision_row(decision, decision_id), _decision_audit_row(decision, decision_id, audit or {})
        unsealed = [_unsealed(decision_id, sample) for sample in samples]
        sample_rows = [_sample_row(decision_id, record, self.sample_text) for record, _ in unsealed]
        _append(self.decisions, rows[0])
        _append(self.audits, rows[1])
        for row in sample_rows:
            _append(self.samples, row)
        for _, sealed_row in unsealed:
            if sealed_row is not None:
                _append(self.sealed, sealed_row)
        self.count += 1

    def extend(self, other: "_DecisionBatch") -> None:
        for mine, theirs in ((self.decisions, other.decisions), (self.audits, other.audits),
                             (self.samples, other.samples), (self.sealed, other.sealed)):
            for column, more in zip(mine, theirs):
                column.extend(more)
        self.count += other.count


# -- encoding rows -----------------------------------------------------------------------

def _append(columns: list[list[Any]], row: Sequence[Any]) -> None:
    for column, value in zip(columns, row):
        column.append(value)


def _stage_row(change: Mapping[str, Any]) -> list[Any]:
    """One registry row; its id is a digest of the change, so writing it twice keeps one."""
    bundle_id, ts = change["bundle_id"], _finite(change["ts"], "ts")
    _require_text(bundle_id, "bundle_id")
    detail = _json(change.get("detail") or {})
    body = _json({"bundle_id": bundle_id, "ts": ts, "stage": change["stage"], "actor": change["actor"],
                  "reason": change.get("reason", ""), "decision_id": change.get("decision_id"), "detail": detail})
    change_id = "s-" + hashlib.sha256(body.encode()).hexdigest()[:16]
    return [change_id, ts, bundle_id, change["stage"], change.get("previous_stage"),
            float(change.get("cohort_share") or 0.0), change["actor"], change.get("reason", ""),
            change.get("decision_id"), detail, int(change.get("seq") or 0)]


def _decision_row(decision: Decision, decision_id: str) -> list[Any]:
    line = decision.to_json_line()
    evidence = json.loads(line)["evidence"]  # the canonical form: sorted keys, NaN as null
    return [decision_id, decision.ts, decision.bundle_id, decision.bucket, decision.cohort,
            decision.action, decision.reason, decision.detector, _json(evidence),
            list(decision.sample_ids), line]


def _decision_audit_row(decision: Decision, decision_id: str, audit: Mapping[str, Any]) -> list[Any]:
    if not isinstance(audit, abc.Mapping):
        raise TypeError(f"audit must be a dict, not {type(audit).__name__}")
    extra = {k: v for k, v in audit.items() if k not in ("thresholds", "baseline", "window", "card")}
    return [f"a-{decision_id}", decision.ts, "decision", "specwatch", decision_id, decision.bundle_id,
            decision.key, decision.reason, decision.detector, _json(audit.get("thresholds")),
            _json(audit.get("baseline")), _json(audit.get("window")), _json(audit.get("card")),
            _json(extra or None)]


def _unsealed(decision_id: str, sample: Mapping[str, Any] | Any) -> tuple[Any, list[Any] | None]:
    """A sample without its sealed token ids, and the sealed-samples row that keeps them apart."""
    record = sample.model_dump(mode="json") if hasattr(sample, "model_dump") else sample
    inner = record.get("sample") if isinstance(record, abc.Mapping) else None
    sealed = inner.get("sealed") if isinstance(inner, abc.Mapping) else None
    if sealed is None:
        return record, None
    key_id = sealed_key_id(sealed)  # a malformed payload is a bad sample: refused here
    try:
        row = [decision_id, str(record["id"]), _finite(record["ts"], "sample ts"), record["bundle_id"], key_id,
               inner.get("prompt_sha256") or "", inner.get("output_sha256") or "", sealed]
    except KeyError as exc:
        raise ValueError(f"sealed sample for {decision_id} has no {exc.args[0]!r}") from None
    return {**record, "sample": {k: v for k, v in inner.items() if k != "sealed"}}, row


def _retention_days(environ: Mapping[str, str]) -> int:
    text = environ.get(_SEALED_RETENTION_ENV, "").strip()
    if not text:
        return _DEFAULT_SEALED_RETENTION_DAYS
    if not text.isdigit() or not 1 <= int(text) <= 36500:
        raise ValueError(f"{_SEALED_RETENTION_ENV} must be a whole number of days from 1 to 36500, got {text!r}")
    return int(text)


def _sample_row(decision_id: str, sample: Mapping[str, Any] | Any,
                sample_text: str = _DEFAULT_SAMPLE_TEXT) -> list[Any]:
    record = sample.model_dump(mode="json") if hasattr(sample, "model_dump") else sample
    if not isinstance(record, abc.Mapping):
        raise TypeError(f"a sample must be a contract-v1 record dict, not {type(record).__name__}")
    record = redact_record(record, sample_text)
    kind = record.get("kind")
    if kind not in _SAMPLE_KINDS:
        raise ValueError(f"sample kind {kind!r} is not one of {', '.join(_SAMPLE_KINDS)}")
    try:
        ts = _finite(record["ts"], "sample ts")
        bundle_id = record["bundle_id"]
        if kind == "step":
            sample_id = f"{record['worker']}:{record['seq']}"
            # A step carries many requests; its bucket/cohort are set only when they agree.
            buckets = {r.get("bucket") for r in record.get("requests", ())}
            cohorts = {r.get("cohort") for r in record.get("requests", ())}
            bucket = buckets.pop() if len(buckets) == 1 else None
            cohort = cohorts.pop() if len(cohorts) == 1 else None
        else:
            sample_id = record["id"]
            bucket, cohort = record.get("bucket"), record.get("cohort")
    except KeyError as exc:
        raise ValueError(f"{kind} sample for {decision_id} has no {exc.args[0]!r}") from None
    return [decision_id, kind, str(sample_id), ts, bundle_id, bucket, cohort, record.get("worker"),
            _json(record)]


def _window_stats_table(rows: Sequence[Mapping[str, Any]], offset: int) -> pa.Table:
    """Window-stats rows as an Arrow table, with the checks a ClickHouse insert would not do.

    >>> row = dict.fromkeys(WINDOW_STATS_FIELDS, 1)
    >>> row.update(ts=10.0, bundle_id="b-1", bucket="coding", cohort=None, speedup=float("nan"),
    ...            accepted_at_least=[1], drafted_at_least=[1])
    >>> table = _window_stats_table([row], 0)
    >>> table.column("speedup").null_count, table.column("rounds").type
    (1, DataType(uint64))
    >>> _window_stats_table([row, dict(row, rounds=2.5)], 40)
    Traceback (most recent call last):
    ...
    ValueError: window stats row 41: 'rounds' is a count, not 2.5
    """
    # Numbers stream through one C-level pass (itemgetter, chain, fromiter) into a
    # float64 matrix, None becoming NaN: about a quarter of the cost of per-field
    # comprehensions and casts at this width.
    try:
        flat = np.fromiter(itertools.chain.from_iterable(map(_WINDOW_NUMBER_VALUES, rows)),
                           dtype=np.float64, count=len(rows) * len(_WINDOW_NUMBERS))
        texts = {name: [row[name] for row in rows] for name in _WINDOW_TEXT}
    except (KeyError, TypeError, ValueError):
        raise _window_culprit(rows, offset) from None
    matrix = flat.reshape(len(rows), len(_WINDOW_NUMBERS))
    columns = dict(zip(_WINDOW_NUMBERS, np.ascontiguousarray(matrix.T)))
    arrays = []
    for name in WINDOW_STATS_FIELDS:
        if name in _WINDOW_ARRAYS:
            array, bad = _count_lists(rows, name)
        elif name in _WINDOW_TEXT:
            try:
                array = pa.array(texts[name], type=_STR)
            except pa.ArrowException:
                raise _window_culprit(rows, offset) from None
            bad = ([i for i, v in enumerate(texts[name]) if v is None]
                   if name == "bundle_id" and array.null_count else ())
        else:
            column = columns[name]
            if name in _FLOAT_SET:
                array, bad = pa.array(column, mask=np.isnan(column)), ()  # NaN -> NULL
            elif name == "ts":
                array, bad = pa.array(column), np.flatnonzero(~np.isfinite(column))
            elif name == "speculation_on":
                array, bad = pa.array(column == 1), np.flatnonzero((column != 0) & (column != 1))
            else:
                with np.errstate(invalid="ignore"):
                    whole = np.isfinite(column) & (column >= 0) & (column == np.floor(column))
                    bad = np.flatnonzero(~whole)
                array = pa.array(column.astype(np.uint64)) if not len(bad) else None
        if len(bad):
            index = int(bad[0])
            raise ValueError(f"window stats row {offset + index}: {name!r} is "
                             f"{_WINDOW_EXPECTED[name]}, not {rows[index][name]!r}")
        arrays.append(array)
    return pa.Table.from_arrays(arrays, names=list(WINDOW_STATS_FIELDS))


def _count_lists(rows: Sequence[Mapping[str, Any]], name: str) -> tuple[pa.Array | None, list[int]]:
    """One list-of-counts column, or the rows whose value is not a list of whole numbers >= 0."""
    values = [row[name] for row in rows]
    bad = [i for i, v in enumerate(values) if not isinstance(v, (list, tuple))
           or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in v)]
    return (None if bad else pa.array(values, type=pa.list_(pa.uint64()))), bad


def _window_culprit(rows: Sequence[Mapping[str, Any]], offset: int) -> ValueError:
    """The error naming the first row or value that would not convert."""
    for index, row in enumerate(rows):
        if not isinstance(row, abc.Mapping):
            return ValueError(f"window stats row {offset + index} is a {type(row).__name__}, not a dict")
        missing = [name for name in WINDOW_STATS_FIELDS if name not in row]
        if missing:
            return ValueError(f"window stats row {offset + index} lacks {', '.join(map(repr, missing))}")
        for name in WINDOW_STATS_FIELDS:
            value = row[name]
            if name in _WINDOW_TEXT:
                fits = isinstance(value, str) or (value is None and name != "bundle_id")
            elif name in _WINDOW_ARRAYS:
                fits = True  # checked column by column in `_count_lists`
            else:
                try:
                    float(value)
                    fits = True
                except (TypeError, ValueError):
                    fits = value is None
            if not fits:
                return ValueError(f"window stats row {offset + index}: {name!r} is "
                                  f"{_WINDOW_EXPECTED[name]}, not {value!r}")
    return ValueError(f"window stats rows {offset}..{offset + len(rows) - 1} do not convert")


def _json(value: Any) -> str:
    """Compact JSON with sorted keys; NaN and infinities become null (JSON has neither).

    >>> _json({"b": float("nan"), "a": [1.5, (2, 3)]})
    '{"a":[1.5,[2,3]],"b":null}'
    """
    try:  # most values are plain already: one C-level pass
        return json.dumps(value, separators=(",", ":"), sort_keys=True, allow_nan=False)
    except (ValueError, TypeError):
        return json.dumps(_plain(value), separators=(",", ":"), sort_keys=True, allow_nan=False,
                          default=_json_default)


def _plain(value: Any) -> Any:
    kind = type(value)
    if kind is float:
        return value if math.isfinite(value) else None
    if kind is dict:
        return {str(k): _plain(v) for k, v in value.items()}
    if kind is list or kind is tuple:
        return [_plain(v) for v in value]
    if kind is str or kind is int or kind is bool or value is None:
        return value
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, abc.Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "model_dump"):
        return _plain(value.model_dump(mode="json"))
    if hasattr(value, "tolist") and callable(value.tolist):  # numpy scalars and arrays
        return _plain(value.tolist())
    return value


def _json_default(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    raise TypeError(f"cannot archive a {type(value).__name__} as JSON")


def _finite(value: Any, name: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, not {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, not {value!r}")
    return number


def _require_text(value: Any, name: str) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string, not {value!r}")


# -- decoding rows -----------------------------------------------------------------------

def _decision_out(row: dict) -> dict:
    row["evidence"] = json.loads(row["evidence"])
    row["sample_ids"] = list(row["sample_ids"])
    return row


def _audit_out(row: dict) -> dict:
    for name in _AUDIT_JSON:
        row[name] = json.loads(row[name]) if row[name] else None
    window = row.get("window")
    if isinstance(window, list):
        # Window slices read back like timeline rows: undefined ratios are NaN again.
        for entry in window:
            if isinstance(entry, dict):
                for key, value in entry.items():
                    if value is None and key in _FLOAT_SET:
                        entry[key] = math.nan
    return row


_FILTER_TYPES = {"bundle_id": "String", "bucket": "String", "cohort": "String", "reason": "String",
                 "action": "String", "kind": "String", "source": "String"}


def _filters(**given: Any) -> tuple[str, dict[str, Any]]:
    """A WHERE clause with bound parameters for the filters that are set.

    >>> where, params = _filters(bundle_id="b-1", bucket="*", since=5.0, until=None)
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
