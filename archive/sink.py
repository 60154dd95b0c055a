"""The archive sink: each final slice's decisions, window stats, bundle cards and sightings into
the archive, through a local spool while the archive is away."""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from specwatch.archive.dsn import ArchiveDsn
from specwatch.archive.spool import Spool, SpoolFull, SpoolStats, describe_kinds
from specwatch.archive.rows import DEFAULT_SAMPLE_TEXT
from specwatch.archive.store import Archive, sample_text_mode
from specwatch.schemas import Decision
from specwatch.schemas.redaction import redact_record
from specwatch.schemas.outputs import SliceOutput, WindowRow

__all__ = ["ARCHIVE_SPOOL_ENV", "ArchiveSink", "default_spool_dir", "spool_dir_for"]

_LOG = logging.getLogger(__name__)
# ClickHouse prefers few big inserts (each is a part on disk): 20,000 rows per insert took a
# third of the CPU of 5,000 in the bench; a live worker flushes at every checkpoint anyway.
_DEFAULT_WINDOW_BATCH = 20_000
_DEFAULT_RETRY_BACKOFF_S = 1.0
_DEFAULT_MAX_RETRY_BACKOFF_S = 60.0
ARCHIVE_SPOOL_ENV = "SPECWATCH_ARCHIVE_SPOOL"
_DEFAULT_SPOOL_BASE = Path("~/.cache/specwatch/archive-spool")


def default_spool_dir(archive_label: str, environ: Mapping[str, str] | None = None) -> Path:
    """Where rows for one archive wait: one directory per archive, replayed only into that archive.

    >>> default_spool_dir("chdb:///srv/a", {"SPECWATCH_ARCHIVE_SPOOL": "/var/spool/specwatch"})
    PosixPath('/var/spool/specwatch/a-978949a7ba996a35')
    """
    environ = os.environ if environ is None else environ
    base = Path(environ.get(ARCHIVE_SPOOL_ENV) or _DEFAULT_SPOOL_BASE).expanduser()
    return base / ("a-" + hashlib.sha256(archive_label.encode("utf-8")).hexdigest()[:16])


def spool_dir_for(dsn: ArchiveDsn | str | None = None, environ: Mapping[str, str] | None = None) -> Path:
    """The spool directory of the archive at ``dsn`` (default: `archive_dsn`); ValueError for a bad DSN.

    >>> env = {"SPECWATCH_ARCHIVE_SPOOL": "/var/spool/specwatch"}
    >>> spool_dir_for("chdb:///srv/a", env) == default_spool_dir("chdb:///srv/a", env)
    True
    """
    environ = os.environ if environ is None else environ
    return default_spool_dir(ArchiveDsn.of(dsn, environ).label, environ)


# What each kind of spool entry holds (`ArchiveSink._put` writes them): a replay sets aside
# anything else instead of failing on it at every run.
_ENTRY_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "decision": {"line": (str,), "audit": (dict, type(None)), "samples": (list, type(None))},
    "windows": {"rows": (list,)},
    "bundle": {"bundle_id": (str,), "card": (dict,), "ts": (int, float), "worker": (str,)},
    "sightings": {"rows": (list,)},
    "stages": {"changes": (list,)},
}


def _entry_problem(entry: Mapping[str, Any]) -> str | None:
    """Why a spool entry is not a row the archive takes, or None.

    >>> _entry_problem({"k": "decision", "bogus": 1})
    "a decision entry without a valid 'line'"
    >>> _entry_problem({"k": "windows", "rows": [{"ts": 1.0}]}) is None, _entry_problem({"k": "mystery"})
    (True, "an entry of unknown kind 'mystery'")
    """
    kind = entry.get("k")
    fields = _ENTRY_FIELDS.get(kind) if isinstance(kind, str) else None
    if fields is None:
        return f"an entry of unknown kind {str(kind)[:32]!r}"
    for name, types in fields.items():
        value = entry.get(name)
        if isinstance(value, bool) or not isinstance(value, types):
            return f"a {kind} entry without a valid {name!r}"
    for name in ("rows", "changes"):
        if name in fields and not all(isinstance(row, dict) for row in entry[name]):
            return f"a {kind} entry with a {name} item that is not an object"
    if kind == "decision":
        try:
            Decision.model_validate_json(entry["line"])
        except ValueError as error:  # pydantic's ValidationError is one
            return f"a decision entry whose line is not a decision ({_first_line(error)[:200]})"
        if not all(isinstance(sample, dict) for sample in entry.get("samples") or ()):
            return "a decision entry with a sample that is not an object"
    return None


def _is_data_error(error: BaseException) -> bool:
    """A row the archive will never take (a bug upstream), as opposed to an archive that is away."""
    from clickhouse_connect.driver.exceptions import ClickHouseError

    return isinstance(error, (ValueError, TypeError)) and not isinstance(error, ClickHouseError)


class ArchiveSink:
    """Writes stage-2 output to an `Archive`, decisions at once and window rows in batches; while
    the archive is away, to a `Spool` replayed with backoff (docs/RELIABILITY.md). ``archive`` is an
    `Archive` or a function opening one (retried while it raises); then ``sample_text`` and
    ``archive_label`` stand for the archive's own until it opens."""

    def __init__(self, archive: Any, window_batch: int = _DEFAULT_WINDOW_BATCH, *,
                 spool: Spool | str | os.PathLike | None = None, sample_text: str = DEFAULT_SAMPLE_TEXT,
                 clock: Callable[[], float] = time.monotonic,
                 outage_log_level: int = logging.WARNING, archive_label: str | None = None) -> None:
        if window_batch < 1:
            raise ValueError(f"window_batch must be at least 1, got {window_batch}")
        opener = None if hasattr(archive, "write_decisions") else archive
        if opener is not None and not callable(opener):
            raise TypeError(f"archive must be an Archive or a function opening one, not {type(archive).__name__}")
        if spool is None:
            if opener is not None:
                raise ValueError("an archive opened later needs its spool named (spool=...)")
            spool = default_spool_dir(getattr(archive, "label", repr(archive)))
        self.archive = None if opener is not None else archive
        self._opener = opener
        self._owned = False
        self.spool = spool if isinstance(spool, Spool) else Spool(spool)
        self.window_batch = window_batch
        self._sample_text = getattr(archive, "sample_text", sample_text) if opener is None else sample_text
        self._windows: list[Sequence[WindowRow]] = []  # each final slice's window rows, as stage 2 handed them over
        self._window_rows = 0
        # (bundle_id, worker) -> [first, last] seen, in memory; spans that grew since they were
        # last written go out with the next batch of window rows, new ones at once.
        self._spans: dict[tuple[str, str], list[float]] = {}
        self._grown: set[tuple[str, str]] = set()
        self._clock = clock
        self._backoff = _DEFAULT_RETRY_BACKOFF_S
        self._retry_at = -float("inf")
        self._outage = False
        self._written = self._spooled = self._dropped = self._dropped_rows = self._outages = 0
        self._failed_replays = 0
        self._outage_log_level = outage_log_level
        self._first_error: str | None = None
        self._pending_at_start = 0 if self.spool.empty else self.spool.pending_bytes
        self._archive_label = getattr(archive, "label", None) if opener is None else archive_label
        if opener is not None:
            self._try_open()

    @classmethod
    def open(cls, dsn: ArchiveDsn | str | None = None, *, spool: Spool | str | os.PathLike | None = None,
             environ: Mapping[str, str] | None = None, require_archive: bool = False,
             **settings: Any) -> "ArchiveSink":
        """The sink for the archive at ``dsn`` (default: `archive_dsn`) with its spool, spooling
        until the archive opens; with ``require_archive`` it opens it now or raises ArchiveError."""
        environ = os.environ if environ is None else environ
        dsn = ArchiveDsn.of(dsn, environ)  # checks a DSN given as text now
        label = dsn.label
        sample_text = sample_text_mode(environ, settings.pop("sample_text", None))
        spool = spool if spool is not None else default_spool_dir(label, environ)
        if not require_archive:
            return cls(lambda: Archive.open(dsn, environ=environ, sample_text=sample_text), spool=spool,
                       sample_text=sample_text, archive_label=label, **settings)
        archive = Archive.open(dsn, environ=environ, sample_text=sample_text)
        try:
            sink = cls(archive, spool=spool, **settings)
        except BaseException:
            archive.close()
            raise
        sink._owned = True
        return sink

    def __call__(self, output: SliceOutput) -> None:
        self._replay_if_due()
        for bundle in output.bundles:
            self._put({"k": "bundle", "bundle_id": bundle["bundle_id"], "card": bundle["card"],
                       "ts": bundle["ts"], "worker": bundle["worker"]},
                      lambda a, b=bundle: a.write_bundle(b["bundle_id"], b["card"], b["ts"], b["worker"]))
        self._sighted(output.sightings)
        # Most slices carry window rows only: the calls for what they lack are skipped (the
        # sink is called once a slice, about 11 rows, so its own per-call cost is per row).
        if output.actions:
            self.write_actions(output.actions)
        if changes := getattr(output, "stage_changes", ()):
            stage_changes = [dict(c if isinstance(c, Mapping) else vars(c)) for c in changes]
            self._put({"k": "stages", "changes": stage_changes},
                      lambda a, rows=stage_changes: a.write_stage_changes(rows))
        if rows := len(output.windows):
            self._windows.append(output.windows)
            self._window_rows += rows
            if self._window_rows >= self.window_batch:
                self._write_rows()

    def write_actions(self, actions: Sequence[Any]) -> None:
        """Archive decisions (`ActionRecord`s) with their audit rows and samples, made in a slice or
        beside one (an Alertmanager rollback): at once, or into the spool while the archive is away."""
        self._replay_if_due()
        for action in actions:
            self._put(self._decision_entry(action.decision, action.audit, action.samples),
                      lambda a, x=action: a.write_decision(x.decision, x.audit, x.samples))

    def decisions_by(self, detector: str) -> list[Decision]:
        """Every archived decision of ``detector``, oldest first, then those still in the spool;
        what the archive cannot answer (away, not open yet) is left out and logged."""
        found = []
        if self.archive is not None:
            try:
                found = [Decision.model_validate_json(row["line"]) for row in self.archive.decisions(limit=None)
                         if row.get("detector") == detector]
            except Exception as error:  # noqa: BLE001 - away: the spool still answers
                _LOG.warning("the archive %s did not say which %s decisions it holds (%s)", self._label(),
                             detector, _first_line(error))
        for entry in self.spool.entries():
            if entry.get("k") == "decision" and _entry_problem(entry) is None:
                decision = Decision.model_validate_json(entry["line"])
                if decision.detector == detector:
                    found.append(decision)
        return found

    def flush(self) -> None:
        """Everything so far is in the archive or in the spool (on disk) when this returns."""
        self._replay_if_due()
        self._write_rows()

    def retry(self) -> bool:
        """Try to replay the spool now, whatever the backoff says; True when it is empty."""
        self._retry_at = -float("inf")
        self._replay_if_due()
        return self.spool.empty and self.archive is not None

    def close(self) -> None:
        self.flush()
        if not self.spool.empty:
            self.retry()
        if not self.spool.empty:
            _LOG.log(self._outage_log_level, "%d bytes of archive rows stay in the spool %s; they are replayed "
                     "when a sink for this archive starts again", self.spool.pending_bytes, self.spool.directory)
        self.spool.close()
        if self._owned and self.archive is not None:
            self.archive.close()
            self.archive = None

    def stats(self) -> dict[str, Any]:
        """Entries written, spooled and dropped; outages; failed replays; the spool's counters."""
        spool: SpoolStats = self.spool.stats()
        return {"written": self._written, "spooled": self._spooled, "dropped_entries": self._dropped,
                "dropped_rows": self._dropped_rows, "outages": self._outages,
                "failed_replays": self._failed_replays, "archive_down": self._outage,
                "replayed": spool.replayed, "spool_pending_bytes": spool.pending_bytes,
                "spool_corrupt": spool.corrupt, "spool_quarantined": spool.quarantined,
                "spool_set_aside": dict(spool.set_aside)}

    def delivery_note(self) -> str | None:
        """One line, for a command to print after `close`, on rows that wait in the spool, were lost
        or were delivered from an earlier run; None when everything went straight to the archive."""
        stats = self.stats()
        parts = []
        if stats["spool_pending_bytes"]:
            why = self._first_error or "it refused writes"
            away = (f"the archive was unreachable ({why})" if self._label() in why
                    else f"the archive {self._label()} was unreachable ({why})")
            parts.append(f"warning: {away}; {stats['spool_pending_bytes']} bytes of archive rows wait in the spool "
                         f"{self.spool.directory} and go to the archive at the next run that reaches it, "
                         f"or with `specwatch archive flush --archive {self._label()}`")
        if stats["dropped_entries"]:
            parts.append(f"error: {stats['dropped_entries']} archive entries ({stats['dropped_rows']} rows) were LOST: "
                         f"the spool {self.spool.directory} could not take them")
        if stats["spool_set_aside"]:
            parts.append(f"error: {sum(stats['spool_set_aside'].values())} spooled archive entries could not be "
                         f"delivered ({describe_kinds(stats['spool_set_aside'])}): torn, corrupt or not rows; "
                         f"kept beside the segments in {self.spool.directory}")
        if stats["replayed"] and not stats["spool_pending_bytes"]:
            earlier = " from an earlier run" if self._pending_at_start else ""
            parts.append(f"{stats['replayed']} spooled entries{earlier} were delivered to the archive {self._label()}")
        return "; ".join(parts) or None

    def _write_rows(self) -> None:
        if self._windows:
            windows, self._windows, self._window_rows = self._windows, [], 0
            # Dicts only for the spool (JSON on disk), and only when the rows go there.
            self._put(lambda: {"k": "windows", "rows": [row.as_dict() for window in windows for row in window]},
                      lambda a: a.write_windows(windows))
        self._write_spans(self._grown)

    def _sighted(self, sightings) -> None:
        new = set()
        for event in sightings:
            pair = (event["bundle_id"], event["worker"])
            span = self._spans.get(pair)
            if span is None:
                self._spans[pair] = [event["first_seen"], event["ts"]]
                new.add(pair)
                continue
            if event["first_seen"] < span[0] or event["ts"] > span[1]:
                span[0], span[1] = min(span[0], event["first_seen"]), max(span[1], event["ts"])
                self._grown.add(pair)
        self._write_spans(new)

    def _write_spans(self, pairs: set[tuple[str, str]]) -> None:
        if not pairs:
            return
        rows = [{"bundle_id": bundle_id, "worker": worker, "first_seen": first, "last_seen": last}
                for (bundle_id, worker), (first, last) in ((pair, self._spans[pair]) for pair in sorted(pairs))]
        self._grown -= pairs
        self._put({"k": "sightings", "rows": rows}, lambda a: a.write_sightings(rows))

    def _decision_entry(self, decision: Decision, audit: Mapping[str, Any] | None, samples) -> dict:
        records = []
        for sample in samples:
            record = sample.model_dump(mode="json") if hasattr(sample, "model_dump") else sample
            # Redacted before it touches the disk: the spool holds no more text than the archive.
            records.append(redact_record(record, self._sample_text) if isinstance(record, Mapping) else record)
        return {"k": "decision", "line": decision.to_json_line(), "audit": audit, "samples": records}

    def _put(self, entry: dict | Callable[[], dict], direct: Callable[[Any], Any]) -> None:
        # Once anything is spooled, everything is, until the spool is replayed: order is kept.
        if self.archive is not None and self.spool.empty:
            try:
                direct(self.archive)
                self._written += 1
                return
            except Exception as error:  # noqa: BLE001 - sorted out below
                if _is_data_error(error):
                    raise
                self._went_down(error)
        self._spool(entry() if callable(entry) else entry)

    def _spool(self, entry: dict) -> None:
        try:
            self.spool.append(entry)
            self._spooled += 1
        except (SpoolFull, OSError) as error:
            self._dropped += 1
            self._dropped_rows += len(entry.get("rows", ())) or 1
            if self._dropped == 1 or self._dropped % 1000 == 0:
                _LOG.error("archive rows LOST: the spool cannot take them (%s); %d entries dropped so far. "
                           "Decisions still reach the decisions topic; the archive will miss these.",
                           error, self._dropped)

    def _went_down(self, error: BaseException) -> None:
        if not self._outage:
            self._outage = True
            self._outages += 1
            self._first_error = self._first_error or _first_line(error)
            _LOG.log(self._outage_log_level, "the archive %s is not taking writes (%s): spooling to %s and "
                     "retrying with backoff", self._label(), _first_line(error), self.spool.directory)
        self._backoff = _DEFAULT_RETRY_BACKOFF_S
        self._retry_at = self._clock() + self._backoff

    def _replay_if_due(self) -> None:
        if (self.archive is not None and self.spool.empty) or self._clock() < self._retry_at:
            return
        if self.archive is None and not self._try_open():
            return
        try:
            replayed = self.spool.replay(self._write_entries, _entry_problem)
        except Exception as error:  # noqa: BLE001 - still away; keep the spool
            self._failed_replays += 1
            self._backoff = min(self._backoff * 2, _DEFAULT_MAX_RETRY_BACKOFF_S)
            self._retry_at = self._clock() + self._backoff
            _LOG.debug("archive replay failed (next try in %.0f s): %s", self._backoff, _first_line(error))
            return
        self._backoff = _DEFAULT_RETRY_BACKOFF_S
        if self._outage or replayed:
            _LOG.log(self._outage_log_level, "the archive %s takes writes again: %d spooled entries replayed",
                     self._label(), replayed)
        self._outage = False

    def _try_open(self) -> bool:
        try:
            self.archive = self._opener()
        except Exception as error:  # noqa: BLE001 - away at start: spool until it is back
            self._went_down(error)
            return False
        self._owned = True
        self._sample_text = getattr(self.archive, "sample_text", self._sample_text)
        return True

    def _write_entries(self, entries: list[dict]) -> None:
        """One spool segment into the archive: window stats, bundles and sightings, decisions, then stage changes."""
        def rows(kind: str, field: str = "rows") -> list:
            return [row for e in entries if e.get("k") == kind for row in e[field]]

        self.archive.write_window_stats(rows("windows"))
        for e in entries:
            if e.get("k") == "bundle":
                self.archive.write_bundle(e["bundle_id"], e["card"], e["ts"], e["worker"])
        self.archive.write_sightings(rows("sightings"))
        self.archive.write_decisions(
            (Decision.model_validate_json(e["line"]), e.get("audit"), e.get("samples") or [])
            for e in entries if e.get("k") == "decision")
        self.archive.write_stage_changes(rows("stages", "changes"))
        unknown = {e.get("k") for e in entries} - {"windows", "bundle", "sightings", "decision", "stages"}
        if unknown:
            raise ValueError(f"spool entries of unknown kinds {sorted(map(str, unknown))}")

    def _label(self) -> str:
        return getattr(self.archive, "label", None) or self._archive_label or "(not open yet)"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__
