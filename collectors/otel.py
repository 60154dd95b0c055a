"""OpenTelemetry in the engine worker: contract records out as OTel log records, one per step.

Emitting never blocks the engine. The SDK path and the direct path (``sdk=False``, far cheaper:
docs/BENCHMARKS.md) put the same bytes on the telemetry topic.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from opentelemetry.sdk._logs import LoggerProvider, LogRecordProcessor, ReadableLogRecord, ReadWriteLogRecord
from opentelemetry.sdk.resources import Resource

from specwatch.collectors.export import ExportResult, TelemetryExporter
from specwatch.schemas import CONTRACT_VERSION, Rejection, TelemetryRecord
from specwatch.schemas.otlp import EVENT_PREFIX, LogEntry, iter_encoded_chunks, log_entry, record_from_attributes
from specwatch.transport.config import KafkaConfig

__all__ = ["EmitterStats", "TelemetryEmitter", "BoundedLogRecordProcessor",
           "KafkaTelemetryExporter"]

if TYPE_CHECKING:
    from specwatch.collectors.spool import TelemetrySpool

logger = logging.getLogger(__name__)

# A step record is ~1 KB: 65k queued is ~64 MB at worst and several seconds of a fleet's
# output, enough to ride out a broker hiccup without growing without bound.
_DEFAULT_MAX_QUEUE_SIZE = 65_536
_DEFAULT_MAX_BATCH_SIZE = 2_048
_DEFAULT_SCHEDULE_DELAY_MILLIS = 200
_DEFAULT_DROP_WARNING_INTERVAL_S = 10.0
_DEFAULT_SHUTDOWN_TIMEOUT_MILLIS = 5_000
_DEFAULT_SERVICE_NAME = "specwatch"
_DEFAULT_DRAIN_BACKOFF_S = (1.0, 30.0)
_DRAIN_CHUNK = 64
# `stats()` name -> `SpoolStats` field
_SPOOL_STATS = {"spooled": "spooled", "drained": "drained", "spool_pending": "pending_records",
                "spool_dropped_full": "dropped_full", "spool_dropped_expired": "dropped_expired",
                "spool_dropped_unwritable": "dropped_unwritable",
                "spool_corrupt_frames": "corrupt_frames"}

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


class KafkaTelemetryExporter:
    """Writes contract records to Kafka as OTLP ``ExportLogsServiceRequest`` messages.

    Keyed by worker (shadow records: bundle id); with a `TelemetrySpool`, what the broker
    refuses goes to disk and is drained in order (docs/RELIABILITY.md), else it is counted.
    """

    def __init__(self, config: KafkaConfig, *, producer: Any = None,
                 resource: Mapping[str, Any] | None = None, spool: "TelemetrySpool | None" = None,
                 drain_backoff_s: tuple[float, float] = _DEFAULT_DRAIN_BACKOFF_S) -> None:
        self.config = config
        self._resource = resource
        # Chunks leave room under the producer's request limit for Kafka's own headers.
        self._max_chunk_bytes = max(1024, config.max_request_size - 16 * 1024)
        self._new_producer: Callable[[], Any] | None = None
        if producer is None:
            from kafka import KafkaProducer  # imported here: in-process users need no Kafka client

            self._new_producer = lambda: KafkaProducer(**config.producer_settings())
            producer = self._new_producer()
        self._producer = producer
        self._lock = threading.Lock()
        self._counts = collections.Counter()
        self._closed = False
        self._spool = spool
        # Spooling state: set by a failed send (export thread) or delivery (producer thread),
        # cleared by the drain thread once the spool is empty. What is left from an earlier
        # process goes before anything new.
        self._spooling = spool is not None and len(spool) > 0
        self._route_lock = threading.Lock()  # the switch back and an append never interleave
        self._settle_lock = threading.Lock()
        self._settled = True  # no failed delivery waits to be spooled
        self._sequence = 0
        self._failed_in_flight: list[tuple[int, bytes, bytes, int]] = []
        self._drain_backoff_s = drain_backoff_s
        self._drain_wake = threading.Event()
        self._drainer: threading.Thread | None = None
        if spool is not None:
            self._drainer = threading.Thread(target=self._drain_loop, name="specwatch-telemetry-spool", daemon=True)
            self._drainer.start()

    def export(self, batch: Sequence[TelemetryRecord]) -> ExportResult:
        return self.export_entries([log_entry(record) for record in batch])

    def export_entries(self, entries: Sequence[LogEntry]) -> ExportResult:
        """The same as `export`, for records already in their OTLP form (the SDK path)."""
        if self._closed:
            return ExportResult.FAILURE
        groups: dict[str, list[LogEntry]] = {}
        for entry in entries:
            attributes = entry.attributes
            key = attributes.get("specwatch.worker") or attributes.get("specwatch.bundle_id") or ""
            groups.setdefault(str(key), []).append(entry)
        ok = True
        for key, group in groups.items():
            key_bytes = key.encode("utf-8", "replace")
            for payload, count in iter_encoded_chunks(group, max_bytes=self._max_chunk_bytes,
                                                      resource=self._resource):
                ok = self._deliver(key_bytes, payload, count) and ok
        return ExportResult.SUCCESS if ok else ExportResult.FAILURE

    def _deliver(self, key: bytes, payload: bytes, count: int) -> bool:
        if self._spool is None:
            return self._send(key, payload, count)
        failed = not self._spooling and not self._send(key, payload, count)
        if not failed and not self._spooling:
            return True
        if failed:
            if not self._spooling:
                logger.warning("kafka at %s is not taking telemetry; spooling to %s until it does",
                               self.config.bootstrap_servers, self._spool.directory)
            self._settled = False
            self._spooling = True
        if not self._settled:
            self._settle_in_flight()
        with self._route_lock:
            if self._spooling or failed:
                self._spooling = True
                return self._to_spool(key, payload, count)
        return self._send(key, payload, count)  # the drain thread switched back meanwhile

    def _send(self, key: bytes, payload: bytes, count: int) -> bool:
        try:
            future = self._producer.send(self.config.topic, key=key, value=payload)
        except Exception as error:  # noqa: BLE001 - KafkaTimeoutError, size, closed producer...
            self._count(send_errors=1, records_failed=0 if self._spool is not None else count)
            logger.debug("kafka send of %d records failed: %s", count, error)
            return False
        self._count(messages=1, records=count, bytes=len(payload))
        with self._lock:
            self._sequence += 1
            sequence = self._sequence
        future.add_errback(self._delivery_failed, sequence, key, payload, count)
        return True

    def _delivery_failed(self, sequence: int, key: bytes, payload: bytes, count: int,
                         error: BaseException) -> None:
        # kafka-python calls an errback with its bound arguments first. On the producer's
        # thread: with a spool, keep the message in memory; the export or drain thread writes
        # it to the spool in send order (`_settle_in_flight`).
        if self._spool is None:
            self._count(delivery_errors=1, records_failed=count)
            logger.debug("kafka delivery of %d records failed: %s", count, error)
            return
        with self._lock:
            self._counts.update(delivery_errors=1)
            self._failed_in_flight.append((sequence, key, payload, count))
            self._settled = False
        self._spooling = True
        logger.debug("kafka delivery of %d records failed, spooling: %s", count, error)

    def _settle_in_flight(self) -> None:
        """Wait for messages still in the producer, then spool the failed ones, oldest first."""
        with self._settle_lock:
            try:
                self._producer.flush(timeout=(self.config.delivery_timeout_ms + self.config.request_timeout_ms) / 1000)
            except Exception as error:  # noqa: BLE001 - KafkaTimeoutError: what is left fails later
                logger.debug("kafka flush before spooling did not complete: %s", error)
            self._spool_failed_in_flight()

    def _spool_failed_in_flight(self) -> None:
        with self._lock:
            failed, self._failed_in_flight = sorted(self._failed_in_flight), []
            self._settled = True
        with self._route_lock:
            for _, key, payload, count in failed:
                self._to_spool(key, payload, count)

    def _to_spool(self, key: bytes, payload: bytes, count: int) -> bool:
        kept = self._spool.append(key, payload, records=count)
        self._drain_wake.set()
        return kept

    def _drain_loop(self) -> None:
        """The drain thread: while spooling, send the spool's head to Kafka in order."""
        backoff = self._drain_backoff_s[0]
        while not self._closed:
            self._drain_wake.wait(backoff)
            self._drain_wake.clear()
            if self._closed or not self._spooling:
                continue
            if not self._settled or self._failed_in_flight:
                self._settle_in_flight()
            if self._drain_once():
                backoff = self._drain_backoff_s[0]
            else:
                backoff = min(backoff * 2, self._drain_backoff_s[1])
                self._renew_producer()

    def _renew_producer(self) -> None:
        """Replace a producer whose sends failed while spooling.

        An idempotent producer can stay fenced for good by a broker restarted on empty storage.
        """
        if self._new_producer is None or self._closed:
            return
        with self._settle_lock:
            old = self._producer
            try:
                self._producer = self._new_producer()
            except Exception as error:  # noqa: BLE001 - keep the old one and try again later
                logger.debug("could not build a new kafka producer: %s", error)
                return
        self._count(producer_renewals=1)
        try:
            old.close(timeout=0)
        except Exception as error:  # noqa: BLE001 - what it still held is in the spool
            logger.debug("the replaced kafka producer did not close cleanly: %s", error)

    def _drain_once(self) -> bool:
        """Send the spool's oldest messages until it is empty; False when Kafka failed one."""
        spool = self._spool
        timeout_s = (self.config.delivery_timeout_ms + self.config.request_timeout_ms) / 1000
        while not self._closed:
            frames = spool.head(_DRAIN_CHUNK)
            if not frames:
                with self._route_lock:
                    if len(spool) == 0 and not self._failed_in_flight:
                        self._spooling = False
                        logger.warning("kafka at %s takes telemetry again; the spool is drained",
                                       self.config.bootstrap_servers)
                        return True
                continue
            delivered = 0
            try:
                futures = [self._producer.send(self.config.topic, key=f.key, value=f.payload) for f in frames]
                for future in futures:
                    future.get(timeout=timeout_s)
                    delivered += 1
            except Exception as error:  # noqa: BLE001 - the broker is still away
                logger.debug("spool drain: kafka did not take message %d of %d: %s", delivered + 1, len(frames),
                             error)
            spool.commit(delivered)
            sent = frames[:delivered]
            self._count(messages=len(sent), records=sum(f.records for f in sent),
                        bytes=sum(len(f.payload) for f in sent))
            if delivered < len(frames):
                return False
        return True

    def _count(self, **deltas: int) -> None:
        with self._lock:
            self._counts.update(deltas)

    def stats(self) -> dict[str, int]:
        """What went to the producer, what failed (``records_failed``: lost), the spool's counts."""
        with self._lock:
            out = {name: self._counts.get(name, 0) for name in
                   ("messages", "records", "bytes", "send_errors", "delivery_errors", "records_failed",
                    "producer_renewals")}
        spool = self._spool.stats() if self._spool is not None else None
        out.update({name: getattr(spool, field) if spool else 0
                    for name, field in _SPOOL_STATS.items()})
        return out

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """Everything exported so far is in Kafka (spool drained included); False if not within the timeout."""
        if self._closed:
            return True
        deadline = time.monotonic() + max(timeout_millis, 0) / 1000.0
        try:
            self._producer.flush(timeout=max(timeout_millis, 0) / 1000.0)
        except Exception as error:  # noqa: BLE001 - KafkaTimeoutError when the broker is away
            logger.debug("kafka flush did not complete: %s", error)
            return False
        while self._spooling and time.monotonic() < deadline:
            self._drain_wake.set()
            time.sleep(0.05)
        return not self._spooling

    def shutdown(self, timeout_millis: int = _DEFAULT_SHUTDOWN_TIMEOUT_MILLIS) -> None:
        """Close the producer; with a spool, what it holds (and what failed in flight) stays for the next process."""
        if self._closed:
            return
        self._closed = True
        self._drain_wake.set()
        if self._drainer is not None:
            self._drainer.join(max(timeout_millis, 0) / 1000.0 + self.config.request_timeout_ms / 1000.0)
        try:
            self._producer.close(timeout=max(timeout_millis, 0) / 1000.0)
        except Exception as error:  # noqa: BLE001 - closing must not raise into the engine
            logger.warning("kafka producer did not close cleanly: %s", error)
        if self._spool is not None:
            self._spool_failed_in_flight()
            pending = len(self._spool)
            if pending:
                logger.warning("telemetry spool %s keeps %d messages for the next start",
                               self._spool.directory, pending)
            self._spool.close()
