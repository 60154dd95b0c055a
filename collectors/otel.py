"""OpenTelemetry in the engine worker: contract records out as OTel log records, one per step.

Emitting never blocks the engine. The SDK path and the direct path (``sdk=False``, far cheaper:
docs/BENCHMARKS.md) put the same bytes on the telemetry topic.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from opentelemetry.sdk._logs import LoggerProvider, LogRecordProcessor, ReadableLogRecord, ReadWriteLogRecord
from opentelemetry.sdk.resources import Resource

from specwatch.collectors.export import ExportResult, TelemetryExporter
from specwatch.schemas import CONTRACT_VERSION, Rejection, TelemetryRecord
from specwatch.schemas.otlp import EVENT_PREFIX, LogEntry, log_entry, record_from_attributes

__all__ = ["EmitterStats", "TelemetryEmitter", "BoundedLogRecordProcessor"]

logger = logging.getLogger(__name__)

# A step record is ~1 KB: 65k queued is ~64 MB at worst and several seconds of a fleet's
# output, enough to ride out a broker hiccup without growing without bound.
_DEFAULT_MAX_QUEUE_SIZE = 65_536
_DEFAULT_MAX_BATCH_SIZE = 2_048
_DEFAULT_SCHEDULE_DELAY_MILLIS = 200
_DEFAULT_DROP_WARNING_INTERVAL_S = 10.0
_DEFAULT_SHUTDOWN_TIMEOUT_MILLIS = 5_000
_DEFAULT_SERVICE_NAME = "specwatch"

Item = TypeVar("Item")


@dataclass(frozen=True)
class EmitterStats:
    """Counters since start (docs/DEPLOY.md, "Inside the collector")."""

    queued: int
    exported: int
    dropped: int
    failed: int
    rejected: int = 0


class _BoundedBatcher(Generic[Item]):
    """A bounded queue drained in batches by one daemon thread; `offer` never blocks."""

    def __init__(self, export: Callable[[list[Item]], bool], exporter: Any, *, name: str,
                 max_queue_size: int = _DEFAULT_MAX_QUEUE_SIZE,
                 max_batch_size: int = _DEFAULT_MAX_BATCH_SIZE,
                 schedule_delay_millis: float = _DEFAULT_SCHEDULE_DELAY_MILLIS,
                 drop_warning_interval_s: float = _DEFAULT_DROP_WARNING_INTERVAL_S,
                 shutdown_timeout_millis: float = _DEFAULT_SHUTDOWN_TIMEOUT_MILLIS) -> None:
        if max_queue_size < 1:
            raise ValueError(f"max_queue_size must be at least 1, got {max_queue_size}")
        if not 1 <= max_batch_size <= max_queue_size:
            raise ValueError(f"max_batch_size must be between 1 and max_queue_size ({max_queue_size}), "
                             f"got {max_batch_size}")
        if schedule_delay_millis <= 0:
            raise ValueError(f"schedule_delay_millis must be positive, got {schedule_delay_millis}")
        self._export = export
        self._exporter = exporter
        self._name = name
        self._max_queue_size = max_queue_size
        self._max_batch_size = max_batch_size
        self._delay_s = schedule_delay_millis / 1000.0
        self._shutdown_timeout_s = max(shutdown_timeout_millis, 0) / 1000.0
        self._warning_interval_s = drop_warning_interval_s
        # deque append/popleft are atomic under the GIL: producers take no lock at all.
        self._queue: collections.deque[Item] = collections.deque()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._flush_waiters: list[threading.Event] = []
        self._stopping = False
        self._dropped = 0
        self._exported = 0
        self._failed = 0
        self._warned_drops = 0
        self._last_warning = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def offer(self, item: Item) -> bool:
        queue = self._queue
        if self._stopping or len(queue) >= self._max_queue_size:
            with self._lock:
                self._dropped += 1
            return False
        queue.append(item)
        if len(queue) >= self._max_batch_size:
            self._wake.set()
        return True

    def stats(self, rejected: int = 0) -> EmitterStats:
        with self._lock:
            dropped = self._dropped
        return EmitterStats(len(self._queue), self._exported, dropped, self._failed, rejected)

    def force_flush(self, timeout_millis: float) -> bool:
        """Export what is queued, then flush the exporter; False if that did not finish in time."""
        deadline = time.monotonic() + timeout_millis / 1000.0
        if self._thread.is_alive():
            done = threading.Event()
            with self._lock:
                self._flush_waiters.append(done)
            self._wake.set()
            drained = done.wait(max(timeout_millis, 0) / 1000.0)
        else:
            drained = not self._queue
        return drained and bool(self._exporter.force_flush(max(0, int((deadline - time.monotonic()) * 1000))))

    def shutdown(self) -> None:
        """Stop taking records, export what is queued (bounded wait), then shut the exporter down."""
        self._stopping = True
        self._wake.set()
        self._thread.join(self._shutdown_timeout_s)
        if self._thread.is_alive():
            logger.warning("telemetry export did not finish within %g s at shutdown; %d records left",
                           self._shutdown_timeout_s, len(self._queue))
        self._exporter.shutdown()

    def _run(self) -> None:
        while True:
            self._wake.wait(self._delay_s)
            self._wake.clear()
            with self._lock:
                # Waiters registered now are answered after this drain: everything they
                # emitted before asking is already in the queue.
                waiters, self._flush_waiters = self._flush_waiters, []
            stopping = self._stopping
            self._drain()
            for waiter in waiters:
                waiter.set()
            self._maybe_warn()
            if stopping:
                self._drain()
                return

    def _drain(self) -> None:
        queue, size = self._queue, self._max_batch_size
        while queue:
            batch = []
            while queue and len(batch) < size:
                batch.append(queue.popleft())
            try:
                ok = self._export(batch)
            except Exception:  # noqa: BLE001 - an exporter bug must not kill the export thread
                logger.exception("%s: exporter raised; %d records lost", self._name, len(batch))
                ok = False
            if ok:
                self._exported += len(batch)
            else:
                self._failed += len(batch)

    def _maybe_warn(self) -> None:
        now = time.monotonic()
        if now - self._last_warning < self._warning_interval_s:
            return
        with self._lock:
            dropped = self._dropped
        new = dropped - self._warned_drops
        if new:
            logger.warning("%s: queue full, dropped %d records in the last %.0f s (%d in total); "
                           "the exporter is slower than the engine or down", self._name, new,
                           now - self._last_warning, dropped)
        self._warned_drops = dropped
        self._last_warning = now


class BoundedLogRecordProcessor(LogRecordProcessor):
    """Batches ``specwatch.*`` OTel log records, never blocking `on_emit`, back to contract
    records for a `TelemetryExporter` (one that takes OTLP entries gets them as they are).

    Unlike the SDK's BatchLogRecordProcessor it counts what it drops and warns periodically.
    """

    def __init__(self, exporter: TelemetryExporter, **batching: float) -> None:
        self._target = exporter
        self._export_entries = getattr(exporter, "export_entries", None)
        self._rejected = 0
        # on_emit runs on the emitting thread; this tells that thread whether it was kept.
        self._last_offer = threading.local()
        self._batcher: _BoundedBatcher[ReadableLogRecord] = _BoundedBatcher(
            self._export, exporter, name="specwatch-otel-export", **batching)

    def _export(self, batch: list[ReadableLogRecord]) -> bool:
        entries = [LogEntry(r.log_record.event_name or "", r.log_record.timestamp or 0,
                            r.log_record.attributes or {}) for r in batch]
        if self._export_entries is not None:
            return self._export_entries(entries) is ExportResult.SUCCESS
        records = []
        for event_name, time_unix_nano, attributes in entries:
            decoded = record_from_attributes(event_name, attributes, time_unix_nano)
            if isinstance(decoded, Rejection):
                self._rejected += 1
                logger.debug("dropping an OTel log record that is not a contract record: %s",
                             decoded.detail)
            else:
                records.append(decoded)
        return not records or self._target.export(records) is ExportResult.SUCCESS

    def on_emit(self, log_record: ReadWriteLogRecord) -> None:
        event_name = log_record.log_record.event_name
        if event_name and event_name.startswith(EVENT_PREFIX):
            self._last_offer.accepted = self._batcher.offer(log_record)

    def last_offer_accepted(self) -> bool:
        """Whether the last record this thread emitted was queued (False: dropped)."""
        return getattr(self._last_offer, "accepted", False)

    def enabled(self, *, event_name: str | None = None, **_: Any) -> bool:
        return event_name is None or event_name.startswith(EVENT_PREFIX)

    def stats(self) -> EmitterStats:
        return self._batcher.stats(self._rejected)

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return self._batcher.force_flush(timeout_millis)

    def shutdown(self) -> None:
        self._batcher.shutdown()


class TelemetryEmitter:
    """What collectors call once per engine step (and per finished request): `emit(record)`.

    It owns ``exporter``; its settings are in docs/DEPLOY.md, "Inside the collector".

    >>> from specwatch.collectors.export import InMemoryExporter
    >>> from specwatch.schemas import ShadowRecord
    >>> sink = InMemoryExporter()
    >>> with TelemetryEmitter(sink) as emitter:
    ...     emitter.emit(ShadowRecord(v=1, ts=1.0, bundle_id="b-1", id="r1", bucket="coding",
    ...                               check="token_exact", match=True))
    ...     emitter.force_flush()
    True
    True
    >>> [r.id for r in sink.records], emitter.stats().exported
    (['r1'], 1)
    """

    def __init__(self, exporter: TelemetryExporter, *, sdk: bool = True, service_name: str = _DEFAULT_SERVICE_NAME,
                 **batching: float) -> None:
        self._closed = False
        self.provider: LoggerProvider | None = None
        self._processor: BoundedLogRecordProcessor | None = None
        self._batcher: _BoundedBatcher[TelemetryRecord] | None = None
        if sdk:
            self._processor = BoundedLogRecordProcessor(exporter, **batching)
            # The emitter owns shutdown; an atexit hook here would race the owner's.
            self.provider = LoggerProvider(resource=Resource.create({"service.name": service_name}),
                                           shutdown_on_exit=False)
            self.provider.add_log_record_processor(self._processor)
            self._logger = self.provider.get_logger("specwatch", str(CONTRACT_VERSION))
        else:
            self._batcher = _BoundedBatcher(
                lambda batch: exporter.export(batch) is ExportResult.SUCCESS, exporter,
                name="specwatch-telemetry-export", **batching)

    def emit(self, record: TelemetryRecord) -> bool:
        """Queue one record for export; False when it was dropped (queue full or closed)."""
        if self._batcher is not None:
            return self._batcher.offer(record)
        if self._closed:
            return False
        entry = log_entry(record)
        self._logger.emit(timestamp=entry.time_unix_nano, observed_timestamp=entry.time_unix_nano,
                          attributes=entry.attributes, event_name=entry.event_name)
        return self._processor.last_offer_accepted()

    def stats(self) -> EmitterStats:
        if self._batcher is not None:
            return self._batcher.stats()
        return self._processor.stats()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Export everything emitted so far; False if that did not finish in time."""
        if self._batcher is not None:
            return self._batcher.force_flush(timeout_millis)
        return self.provider.force_flush(timeout_millis)

    def shutdown(self) -> None:
        """Export what is queued (bounded wait), then shut the exporter down. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._batcher is not None:
            self._batcher.shutdown()
        else:
            self.provider.shutdown()

    def __enter__(self) -> "TelemetryEmitter":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
