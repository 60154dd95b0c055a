"""Telemetry as exporters put it on Kafka, and the embedded pipeline's decisions to compare with.

Shared by the tests that feed the stream tasks or runners without a broker.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Iterator

from specwatch.schemas import Decision
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


def decision_key(decision: Decision) -> tuple:
    return (decision.ts, decision.bundle_id, decision.bucket, decision.cohort, decision.action, decision.reason)


def replayed(records: Iterable, *args, **options) -> EmbeddedPipeline:
    """An `EmbeddedPipeline` (made with ``args`` and ``options``) that has taken ``records`` and finished."""
    pipeline = EmbeddedPipeline(*args, **options)
    pipeline.feed_many(records)
    pipeline.finish()
    return pipeline


def archived_replay(records: Iterable, dsn: str) -> list[Decision]:
    """The embedded pipeline's decisions on ``records``, its output archived at ``dsn`` as `specwatch run` does."""
    from specwatch.archive.sink import ArchiveSink
    from specwatch.archive.store import Archive

    with Archive.open(dsn) as archive:
        sink = ArchiveSink(archive)
        decisions = replayed(records, sinks=[sink]).decisions
        sink.close()
    return decisions


def embedded_decisions(records: list, cutoff: float) -> list[tuple]:
    """The embedded pipeline's decisions before ``cutoff``, as sorted `decision_key`s (never empty)."""
    expected = sorted(decision_key(d) for d in replayed(records).decisions if d.ts < cutoff)
    assert expected
    return expected
