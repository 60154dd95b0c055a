"""Telemetry as exporters put it on Kafka, and the embedded pipeline's decisions to compare with,
for the tests that feed exporters, stream tasks or runners without a broker."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Iterable, Iterator

from specwatch.schemas import Decision, RoundEntry, StepRecord
from specwatch.schemas.otlp import encode_records
from specwatch.streams.embedded import EmbeddedPipeline

FLUSH_EVENT_SECONDS = 0.5  # as `specwatch simulate --bootstrap` flushes


def exporter_batches(records: Iterable, flush_event_seconds: float = FLUSH_EVENT_SECONDS
                     ) -> Iterator[tuple[str, float, bytes]]:
    """(source, first event time, OTLP request) per worker (or bundle, for shadows) per flush interval, in send order."""
    pending: dict[str, list] = defaultdict(list)

    def flush():
        for source, chunk in pending.items():
            yield source, chunk[0].ts, encode_records(chunk)
        pending.clear()

    next_flush = None
    for record in records:
        if next_flush is None or record.ts >= next_flush:
            yield from flush()
            next_flush = record.ts + flush_event_seconds
        pending[getattr(record, "worker", None) or record.bundle_id].append(record)
    yield from flush()


def step_record(worker: str, seq: int, requests: int = 4) -> StepRecord:
    """Step ``seq`` of ``worker``, 20 ms of event time after the one before, ``requests`` rounds."""
    rounds = [RoundEntry(id=f"{worker}-{seq}-{i}", bucket="coding", cohort="main", drafted=4,
                         accepted=(seq + i) % 5) for i in range(requests)]
    return StepRecord(v=1, ts=1_000.0 + seq * 0.02, worker=worker, seq=seq, bundle_id="b-1",
                      draft_ms=0.8, verify_ms=10.0, kv_usage=0.5, requests=rounds)


class _Future:
    def __init__(self, error: Exception | None) -> None:
        self.error = error
        self.errbacks = []

    def add_errback(self, f, *args):
        self.errbacks.append((f, args))

    def resolve(self):
        if self.error is not None:
            for f, args in self.errbacks:
                f(*args, self.error)  # as kafka-python calls an errback

    def get(self, timeout=None):
        if self.error is not None:
            raise self.error


class MemoryProducer:
    """kafka-python's producer in memory: sends fail while not ``up``, deliveries on ``flush`` while
    ``fail_deliveries``; ``sent`` holds every (topic, key, value) it took."""

    def __init__(self) -> None:
        self.up = True
        self.fail_deliveries = False
        self.sent: list[tuple[str, bytes, bytes]] = []
        self.delivered: list[bytes] = []
        self.pending: list[tuple[_Future, bytes]] = []
        self.lock = threading.Lock()

    def send(self, topic, key=None, value=None):
        with self.lock:
            if not self.up:
                raise TimeoutError("no metadata: the broker is away")
            future = _Future(ConnectionError("broker gone") if self.fail_deliveries else None)
            self.sent.append((topic, key, value))
            self.pending.append((future, value))
            return future

    def flush(self, timeout=None):
        with self.lock:
            pending, self.pending = self.pending, []
        for future, value in pending:
            if future.error is None:
                self.delivered.append(value)
            future.resolve()

    def close(self, timeout=None):
        self.flush()


def decision_key(decision: Decision) -> tuple:
    return (decision.ts, decision.bundle_id, decision.bucket, decision.cohort, decision.action, decision.reason)


def replayed(records: Iterable, *args, **options) -> EmbeddedPipeline:
    """An `EmbeddedPipeline` (made with ``args`` and ``options``) that has taken ``records`` and finished."""
    pipeline = EmbeddedPipeline(*args, **options)
    pipeline.feed_many(records)
    pipeline.finish()
    return pipeline


def archived_replay(records: Iterable, dsn: str, **options) -> list[Decision]:
    """The embedded pipeline's decisions on ``records``, its output archived at ``dsn`` as `specwatch run` does;
    ``options`` go to the pipeline (``flags``: the simulated engines' flag store, a closed loop)."""
    from specwatch.archive.sink import ArchiveSink
    from specwatch.archive.store import Archive

    with Archive.open(dsn) as archive:
        sink = ArchiveSink(archive)
        decisions = replayed(records, sinks=[sink], **options).decisions
        sink.close()
    return decisions


def embedded_decisions(records: list, cutoff: float) -> list[tuple]:
    """The embedded pipeline's decisions before ``cutoff``, as sorted `decision_key`s (never empty)."""
    expected = sorted(decision_key(d) for d in replayed(records).decisions if d.ts < cutoff)
    assert expected
    return expected
