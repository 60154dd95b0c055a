"""The direct Kafka exporter of the engine side: contract records to the telemetry topic as OTLP
``ExportLogsServiceRequest`` messages, through a `TelemetrySpool` on local disk while the broker is away."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from specwatch.schemas import TelemetryRecord
from specwatch.schemas.exporter import ExportResult
from specwatch.schemas.otlp import LogEntry, iter_encoded_chunks, log_entry

from .clients import kafka_producer
from .config import KafkaConfig
from .telemetry_spool import TelemetrySpool

__all__ = ["KafkaTelemetryExporter"]

logger = logging.getLogger(__name__)

_DEFAULT_SHUTDOWN_TIMEOUT_MILLIS = 5_000
_DEFAULT_DRAIN_BACKOFF_S = (1.0, 30.0)
_DRAIN_CHUNK = 64
# `stats()` name -> `SpoolStats` field
_SPOOL_STATS = {"spooled": "spooled", "drained": "drained", "spool_pending": "pending_records",
                "spool_dropped_full": "dropped_full", "spool_dropped_expired": "dropped_expired",
                "spool_dropped_unwritable": "dropped_unwritable",
                "spool_corrupt_frames": "corrupt_frames"}


class KafkaTelemetryExporter:
    """Writes contract records to Kafka as OTLP ``ExportLogsServiceRequest`` messages.

    Keyed by worker (shadow records: bundle id); with a `TelemetrySpool`, what the broker
    refuses goes to disk and is drained in order (docs/RELIABILITY.md), else it is counted.
    """

    def __init__(self, config: KafkaConfig, *, producer: Any = None,
                 resource: Mapping[str, Any] | None = None, spool: TelemetrySpool | None = None,
                 drain_backoff_s: tuple[float, float] = _DEFAULT_DRAIN_BACKOFF_S) -> None:
        self.config = config
        self._resource = resource
        # Chunks leave room under the producer's request limit for Kafka's own headers.
        self._max_chunk_bytes = max(1024, config.max_request_size - 16 * 1024)
        self._new_producer: Callable[[], Any] | None = None
        if producer is None:
            self._new_producer = lambda: kafka_producer(config)
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
