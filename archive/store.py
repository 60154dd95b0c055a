"""The ClickHouse archive: decisions, their audit trail, reproducible samples and window stats,
in chDB (embedded, on disk) by default or a ClickHouse server one DSN away."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Mapping, Sequence

import pyarrow as pa

from specwatch.actions.flags import FlagStore
from specwatch.archive.client import ArrowInsert, connect, server_insert
from specwatch.archive.columns import (AUDIT, BUNDLE_SIGHTINGS, BUNDLE_STAGES, BUNDLES, DECISIONS,
                                       DEFAULT_SEALED_RETENTION_DAYS, OVERRIDES, QUALIFICATIONS, REPRODUCTIONS,
                                       SAMPLES, SEALED_SAMPLES, TABLES, WINDOW_ADDED, WINDOW_STATS,
                                       Table)
from specwatch.archive.dsn import DEFAULT_DATABASE, ArchiveDsn, check_database_name
from specwatch.archive.errors import ArchiveNotFoundError
from specwatch.archive.jsonvalue import canonical_json, digest_id
from specwatch.archive.queries import PostmortemQueries, where_clause
from specwatch.archive.rows import (DEFAULT_SAMPLE_TEXT, DecisionBatch, append_row, audit_out, finite, require_text,
                                    stage_row, window_columns_table, window_rows_table, window_stats_table)
from specwatch.schemas.slice_stats import window_columns
from specwatch.schemas import Decision, decision_key
from specwatch.schemas.outputs import SliceWindows, WindowRow
from specwatch.schemas.redaction import SAMPLE_TEXT_MODES

__all__ = ["Archive", "sample_text_mode"]

logger = logging.getLogger(__name__)

# Free text in samples (a request's engine error) is archived as a digest unless a
# deployment opts in to a redacted form; never as it came (it may quote a prompt).
_SAMPLE_TEXT_ENV = "SPECWATCH_ARCHIVE_SAMPLE_TEXT"
_SEALED_RETENTION_ENV = "SPECWATCH_SEALED_SAMPLE_DAYS"
# One insert is one part on disk: big enough to amortize, small enough to bound memory
# and to overlap converting one chunk with inserting the previous one.
_DEFAULT_INSERT_CHUNK_ROWS = 65_536
# Deduplication is left to merges and FINAL: collapsing each inserted block on the
# way in halves insert throughput and buys nothing, since readers use FINAL anyway.
_INSERT_SETTINGS = {"optimize_on_insert": 0}
# Who makes stage changes that are not a person's: the admission controller and the policy file.
_AUTOMATIC_ACTORS = ("specwatch", "policy")


class Archive(PostmortemQueries):
    """Decisions, audit rows, samples, window stats, bundles and overrides in ClickHouse, through a
    clickhouse-connect ``client`` the caller keeps owning; ``sample_text`` says how free text in
    samples is kept (`specwatch.schemas.redaction`).

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

    def __init__(self, client: Any, database: str = DEFAULT_DATABASE,
                 sample_text: str = DEFAULT_SAMPLE_TEXT) -> None:
        check_database_name(database)
        if sample_text not in SAMPLE_TEXT_MODES:
            raise ValueError(f"sample_text must be one of {', '.join(SAMPLE_TEXT_MODES)}, got {sample_text!r}")
        self.sample_text = sample_text
        self.sealed_retention_days = DEFAULT_SEALED_RETENTION_DAYS
        self._client = client
        # How Arrow tables reach the engine: set by `open` from the DSN (in memory into chDB,
        # HTTP into a server); a client passed in is written through its own insert_arrow.
        self._insert_arrow: ArrowInsert = functools.partial(server_insert, client)
        self._db = database
        self.label = f"{type(client).__name__}/{database}"  # where it is, never with credentials
        self._release: Callable[[], None] | None = None
        self._lock = threading.Lock()

    @classmethod
    def open(cls, dsn: ArchiveDsn | str | None = None, *, create: bool = True,
             environ: Mapping[str, str] | None = None, sample_text: str | None = None) -> "Archive":
        """Open the archive at `dsn` (default: `archive_dsn()`); with ``create=False`` a missing
        archive raises `ArchiveNotFoundError`."""
        environ = os.environ if environ is None else environ
        sample_text = sample_text_mode(environ, sample_text)
        retention_days = _retention_days(environ)
        parsed = ArchiveDsn.of(dsn, environ)
        location, password = parsed.location, parsed.password
        client, insert_arrow, release = connect(location, password, create=create, environ=environ)
        archive = cls(client, location.database, sample_text)
        archive._insert_arrow = insert_arrow
        archive.sealed_retention_days = retention_days
        archive.label = location.label
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
        return f"Archive({self.label!r})"

    def __enter__(self) -> "Archive":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the client if this archive opened it; a passed-in client stays open."""
        release, self._release = self._release, None
        if release is not None:
            release()

    def ensure_schema(self) -> None:
        """Create the database and every table if missing; safe to call at every start."""
        self._client.command(f"CREATE DATABASE IF NOT EXISTS {self._db}")
        for table in TABLES:
            self._client.command(table.create(self._db))
        for name in WINDOW_ADDED:
            self._client.command(f"ALTER TABLE {self._db}.window_stats ADD COLUMN IF NOT EXISTS "
                                 f"{name} {WINDOW_STATS.kind(name)}")
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

    def write_decision(self, decision: Decision, audit: Mapping[str, Any] | None,
                       samples: Sequence[Mapping[str, Any]] = ()) -> None:
        """Archive one decision with its audit row (``thresholds``, ``baseline``, ``window``,
        ``card``; other keys land in ``detail``) and contract-v1 sample records."""
        self.write_decisions([(decision, audit, samples)])

    def write_decisions(self, items: Iterable[tuple[Decision, Mapping[str, Any] | None,
                                                    Sequence[Mapping[str, Any]]]]) -> int:
        """Archive many decisions in one insert per table; returns how many."""
        batch = DecisionBatch(self.sample_text)
        for decision, audit, samples in items:
            batch.add(decision, audit, samples)
        if not batch.count:
            return 0
        # Samples and audit go first: a decision row present means its evidence is too.
        if batch.samples[0]:
            self._insert(SAMPLES, batch.samples)
        if batch.sealed[0]:
            self._insert(SEALED_SAMPLES, batch.sealed)
        self._insert(AUDIT, batch.audits)
        self._insert(DECISIONS, batch.decisions)
        return batch.count

    def write_window_stats(self, rows: Sequence[Mapping[str, Any]]) -> int:
        """Archive window-stats row dicts (keys: `WINDOW_STATS_FIELDS`); returns how many. NaN is
        stored as NULL; a bad row raises ValueError naming it and stops the write there."""
        return self._write_chunked(rows if isinstance(rows, list) else list(rows), window_stats_table)

    def write_window_rows(self, rows: Sequence[WindowRow]) -> int:
        """Archive window rows (`WindowRow` tuples), column by column; returns how many."""
        return self._write_chunked(rows, window_rows_table)

    def write_windows(self, windows: Sequence[Sequence[WindowRow]], *, per_sketch: bool = False) -> int:
        """Archive the window rows of final slices (`SliceOutput.windows`); returns how many.
        `SliceWindows` become insert columns straight from the keys' statistics, with no row
        object; ``per_sketch`` reads their percentiles sketch by sketch (`window_columns`' reference)."""
        if not all(isinstance(window, SliceWindows) for window in windows):
            return self.write_window_rows([row for window in windows for row in window])
        chunks: list[tuple[int, list[SliceWindows]]] = []
        rows = 0
        for window in windows:
            if not chunks or rows - chunks[-1][0] >= _DEFAULT_INSERT_CHUNK_ROWS:
                chunks.append((rows, []))
            chunks[-1][1].append(window)
            rows += len(window)
        self._insert_chunks(chunks, lambda part, start: window_columns_table(
            window_columns(part, per_sketch=per_sketch), start))
        return rows

    def _write_chunked(self, rows: Sequence[Any], to_table: Callable[[Sequence[Any], int], pa.Table]) -> int:
        self._insert_chunks([(start, rows[start:start + _DEFAULT_INSERT_CHUNK_ROWS])
                             for start in range(0, len(rows), _DEFAULT_INSERT_CHUNK_ROWS)], to_table)
        return len(rows)

    def _insert_chunks(self, chunks: Sequence[tuple[int, Any]], to_table: Callable[[Any, int], pa.Table]) -> None:
        """Insert window-stats chunks, each ``(its first row's index, what to_table builds it from)``."""
        # The engine releases the GIL while it inserts, so converting the next chunk
        # overlaps with inserting this one whenever a second core is free.
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="specwatch-archive") as inserter:
            pending = None
            for start, part in chunks:
                table = to_table(part, start)
                if pending is not None:
                    pending.result()
                if table.num_rows:
                    pending = inserter.submit(self._insert_table, WINDOW_STATS, table)
            if pending is not None:
                pending.result()

    def write_bundle(self, bundle_id: str, card: Mapping[str, Any] | Any, ts: float,
                     worker: str) -> None:
        """Record a bundle's card, seen on ``worker`` at ``ts`` (a sighting too)."""
        require_text(bundle_id, "bundle_id")
        ts = finite(ts, "ts")
        self._insert(BUNDLES,
                     [[bundle_id], [canonical_json(card)], [ts], [ts], [[worker] if worker else []]])
        if worker:
            self.write_sightings([{"bundle_id": bundle_id, "worker": worker, "first_seen": ts, "last_seen": ts}])

    def write_sightings(self, sightings: Sequence[Mapping[str, Any]]) -> int:
        """Record spans of workers running bundles (``bundle_id``, ``worker``, ``first_seen``,
        ``last_seen``); returns how many."""
        columns: list[list[Any]] = [[], [], [], []]
        for row in sightings:
            require_text(row["bundle_id"], "bundle_id")
            require_text(row["worker"], "worker")
            first, last = finite(row["first_seen"], "first_seen"), finite(row["last_seen"], "last_seen")
            if first > last:
                raise ValueError(f"sighting of {row['bundle_id']} on {row['worker']}: first_seen {first} "
                                 f"is after last_seen {last}")
            append_row(columns, (row["bundle_id"], row["worker"], first, last))
        if columns[0]:
            self._insert(BUNDLE_SIGHTINGS, columns)
        return len(columns[0])

    def write_override(self, scope: tuple[str, str | None, str | None], enabled: bool,
                       draft_limit: int | None, by: str, reason: str, ts: float,
                       cleared: bool = False) -> str:
        """Record a manual override (or its clearing) and its audit row; returns its id."""
        bundle_id, bucket, cohort = scope
        require_text(bundle_id, "bundle_id")
        require_text(by, "by (who made the override)")
        ts = finite(ts, "ts")
        if draft_limit is not None and not (isinstance(draft_limit, int) and 1 <= draft_limit <= 64):
            raise ValueError(f"draft_limit must be an integer in 1..64, not {draft_limit!r}")
        body = {"bundle_id": bundle_id, "bucket": bucket, "cohort": cohort, "enabled": bool(enabled),
                "draft_limit": draft_limit, "by": by, "reason": reason, "ts": ts, "cleared": bool(cleared)}
        override_id = digest_id("o-", body)
        self._insert(OVERRIDES,
                     [[v] for v in (override_id, ts, bundle_id, bucket, cohort, bool(enabled),
                                    draft_limit, by, reason, bool(cleared))])
        self._audit_manual(f"a-{override_id}", ts, "override_clear" if cleared else "override", by, bundle_id,
                        scope=decision_key(bundle_id, bucket, cohort), reason=reason,
                        detail="null" if cleared else canonical_json({"enabled": bool(enabled),
                                                                      "draft_limit": draft_limit}))
        return override_id

    def write_stage_changes(self, changes: Iterable[Any]) -> int:
        """Record admission stage changes (`StageChange`s or their dicts) in the bundle registry."""
        rows = [stage_row(c if isinstance(c, Mapping) else vars(c)) for c in changes]
        if rows:
            self._insert(BUNDLE_STAGES, [list(col) for col in zip(*rows)])
        return len(rows)

    def write_manual_stage(self, bundle_id: str, stage: str, by: str, reason: str, ts: float,
                           previous_stage: str | None = None, cohort_share: float = 0.0,
                           cohort: str | None = None) -> str:
        """Record a stage a person put a bundle in, with its audit row; returns the change id."""
        from specwatch.actions.flags import STAGES

        require_text(bundle_id, "bundle_id")
        require_text(by, "by (who made the change)")
        if by in _AUTOMATIC_ACTORS:
            raise ValueError(f"{by!r} names automatic changes; give the name of the person making this one")
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}; choose one of {', '.join(STAGES)}")
        ts = finite(ts, "ts")
        change = {"bundle_id": bundle_id, "ts": ts, "stage": stage, "previous_stage": previous_stage,
                  "cohort_share": float(cohort_share), "actor": by, "reason": reason, "decision_id": None,
                  "detail": {"manual": True, "cohort": cohort}, "seq": len(self.stage_history(bundle_id))}
        row = stage_row(change)
        self._insert(BUNDLE_STAGES, [[v] for v in row])
        self._audit_manual(f"a-{row[0]}", ts, "stage_change", by, bundle_id, scope=decision_key(bundle_id, None, None),
                        reason=reason, detail=canonical_json({"stage": stage, "previous_stage": previous_stage,
                                                              "cohort_share": float(cohort_share), "cohort": cohort}))
        return row[0]

    def _audit_manual(self, audit_id: str, ts: float, kind: str, actor: str, bundle_id: str, *,
                   decision_id: str | None = None, scope: str = "", reason: str = "", detail: str = "null") -> None:
        """The audit row of something a person did: no detector, thresholds, baseline, window or card."""
        self._insert(AUDIT, [[v] for v in (audit_id, ts, kind, actor, decision_id, bundle_id, scope, reason, "",
                                           "null", "null", "null", "null", detail)])

    def sealed_samples(self, decision_id: str) -> list[dict]:
        """The sealed samples of a decision: key id, digests and ciphertext (nothing is opened here)."""
        names = ", ".join(SEALED_SAMPLES.insert_names)
        return self._select(f"SELECT {names} FROM {self._db}.sealed_samples FINAL "
                            "WHERE decision_id = {id:String} ORDER BY ts, sample_id", {"id": decision_id})

    def write_sample_opening(self, decision_id: str, bundle_id: str, actor: str, ts: float,
                             detail: Mapping[str, Any]) -> str:
        """Audit one attempt to open a decision's sealed samples (who, when, which, outcome)."""
        require_text(actor, "actor (who opens the samples)")
        ts = finite(ts, "ts")
        audit_id = digest_id("a-open-", {"decision_id": decision_id, "actor": actor, "ts": ts,
                                         "detail": detail})
        self._audit_manual(audit_id, ts, "sample_open", actor, bundle_id, decision_id=decision_id,
                        detail=canonical_json(detail))
        return audit_id

    def write_reproduction(self, decision_id: str, actor: str, ts: float, verdict: str,
                           result: Mapping[str, Any]) -> str:
        """Archive a `specwatch reproduce` result beside its decision; returns its id."""
        require_text(actor, "actor")
        ts = finite(ts, "ts")
        text = canonical_json(result)
        reproduction_id = "r-" + hashlib.sha256(f"{decision_id}\0{actor}\0{ts!r}\0{text}".encode()).hexdigest()[:16]
        self._insert(REPRODUCTIONS,
                     [[v] for v in (reproduction_id, decision_id, ts, actor, verdict, text)])
        return reproduction_id

    def reproductions(self, decision_id: str) -> list[dict]:
        """The `specwatch reproduce` results archived for a decision, oldest first, ``result`` parsed."""
        return self._rows("reproductions", " WHERE decision_id = {id:String}", {"id": decision_id},
                          "ts, reproduction_id", "result")

    def write_qualification(self, report: Mapping[str, Any]) -> str:
        """Archive a `specwatch qualify` report (a `Qualification` dumped as JSON); returns its id."""
        require_text(report["bundle_id"], "bundle_id")
        bundle_id, ts = report["bundle_id"], finite(report["ts"], "ts")
        text = canonical_json(report)
        qualification_id = "q-" + hashlib.sha256(text.encode()).hexdigest()[:16]
        self._insert(QUALIFICATIONS, [[v] for v in (qualification_id, bundle_id, ts, report["verdict"], text)])
        return qualification_id

    def qualifications(self, bundle_id: str | None = None) -> list[dict]:
        """Qualification reports (``report`` parsed), oldest first; of one bundle when ``bundle_id`` is given."""
        return self._rows("qualifications", *where_clause(bundle_id=bundle_id), "ts, archived_at, qualification_id", "report")

    def stage_history(self, bundle_id: str | None = None) -> list[dict]:
        """Admission stage changes in time order (``detail`` parsed): what changed a stage, when, why."""
        return self._rows("bundle_stages", *where_clause(bundle_id=bundle_id),
                          "ts, seq, archived_at, change_id", "detail")

    def bundle_registry(self) -> list[dict]:
        """Every bundle seen, with its latest admission stage (None when never judged)."""
        latest = self._latest_stages()
        rows = self.bundles()
        seen = {row["bundle_id"] for row in rows}
        rows += [{"bundle_id": b, "card": None, "first_seen": c["ts"], "last_seen": c["ts"], "workers": [],
                  "sightings": []}
                 for b, c in latest.items() if b not in seen]
        for row in rows:
            change = latest.get(row["bundle_id"], {})
            row.update(stage=change.get("stage"), cohort_share=change.get("cohort_share"),
                       stage_since=change.get("ts"), stage_by=change.get("actor"),
                       stage_reason=change.get("reason"))
        return rows

    def overrides(self, active_only: bool = True) -> list[dict]:
        """Manual overrides in time order: the one in force per scope, or every event."""
        if not active_only:
            return self._rows("overrides", "", {}, "ts, archived_at, override_id")
        # The latest event per scope decides; a clearing event means none is active.
        return self._select(f"SELECT * FROM (SELECT * EXCEPT archived_at FROM {self._db}.overrides "
                            "FINAL ORDER BY ts DESC, archived_at DESC, override_id DESC LIMIT 1 BY "
                            "bundle_id, bucket, cohort) WHERE NOT cleared ORDER BY ts, override_id")

    def audit(self, bundle_id: str | None = None, kind: str | None = None,
              since: float | None = None, until: float | None = None) -> list[dict]:
        """Audit rows in time order, JSON fields parsed."""
        where, params = where_clause(bundle_id=bundle_id, kind=kind, since=since, until=until)
        return [audit_out(row) for row in self._rows("audit", where, params,
                                                     "ts, archived_at, audit_id")]

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
            for bundle_id, change in self._latest_stages().items():
                if change["actor"] not in _AUTOMATIC_ACTORS:
                    store.set_stage(bundle_id, change["stage"], change["actor"], change["reason"], change["ts"],
                                    change["detail"].get("cohort"), change["cohort_share"])
        return store

    def _latest_stages(self) -> dict[str, dict]:
        return {change["bundle_id"]: change for change in self.stage_history()}

    def _insert(self, table: Table, columns: list[list[Any]]) -> None:
        schema = table.insert_schema
        arrays = [pa.array(values, type=field.type) for values, field in zip(columns, schema)]
        self._insert_table(table, pa.Table.from_arrays(arrays, schema=schema))

    def _insert_table(self, table: Table, data: pa.Table) -> None:
        with self._lock:
            self._insert_arrow(f"{self._db}.{table.name}", data, _INSERT_SETTINGS)

    def _rows(self, table: str, where: str, params: Mapping[str, Any], order: str,
              *json_columns: str) -> list[dict]:
        """A table's rows as read (``FINAL``, without ``archived_at``), the JSON columns parsed."""
        rows = self._select(f"SELECT * EXCEPT archived_at FROM {self._db}.{table} FINAL{where} "
                            f"ORDER BY {order}", params)
        for row in rows:
            row.update((name, json.loads(row[name])) for name in json_columns)
        return rows

    def _select(self, sql: str, parameters: Mapping[str, Any] | None = None) -> list[dict]:
        with self._lock:
            result = self._client.query(sql, parameters=dict(parameters or {}))
        names = result.column_names
        return [dict(zip(names, row)) for row in result.result_rows]


def sample_text_mode(environ: Mapping[str, str], sample_text: str | None = None) -> str:
    """How free text in samples is kept: ``sample_text``, else ``$SPECWATCH_ARCHIVE_SAMPLE_TEXT``,
    else ``"hashes"``; ValueError for a mode that is not one of `SAMPLE_TEXT_MODES`.

    >>> sample_text_mode({"SPECWATCH_ARCHIVE_SAMPLE_TEXT": "redacted"}), sample_text_mode({}, "hashes")
    ('redacted', 'hashes')
    """
    sample_text = sample_text or environ.get(_SAMPLE_TEXT_ENV) or DEFAULT_SAMPLE_TEXT
    if sample_text not in SAMPLE_TEXT_MODES:
        raise ValueError(f"{_SAMPLE_TEXT_ENV} must be one of {', '.join(SAMPLE_TEXT_MODES)}, "
                         f"got {sample_text!r}")
    return sample_text


def _retention_days(environ: Mapping[str, str]) -> int:
    text = environ.get(_SEALED_RETENTION_ENV, "").strip()
    if not text:
        return DEFAULT_SEALED_RETENTION_DAYS
    if not text.isdigit() or not 1 <= int(text) <= 36500:
        raise ValueError(f"{_SEALED_RETENTION_ENV} must be a whole number of days from 1 to 36500, got {text!r}")
    return int(text)
