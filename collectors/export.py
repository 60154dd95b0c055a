"""The one exporter interface every telemetry sink implements (Kafka, in-process, memory).

Batching lives in the provider, not in sinks: a sink only moves a batch somewhere.
"""

from __future__ import annotations

import enum
from typing import Protocol, Sequence

from specwatch.schemas import TelemetryRecord

__all__ = ["ExportResult", "TelemetryExporter", "InMemoryExporter", "CallbackExporter"]


class ExportResult(enum.Enum):
    SUCCESS = 0
    FAILURE = 1


class TelemetryExporter(Protocol):
    """Where contract-v1 records go. Must never block the engine for long."""

    def export(self, batch: Sequence[TelemetryRecord]) -> ExportResult: ...

    def force_flush(self, timeout_millis: int = 30_000) -> bool: ...

    def shutdown(self) -> None: ...


class CallbackExporter:
    """Hands each batch to a function in the same process (the embedded pipeline's feed)."""

    def __init__(self, callback) -> None:
        self._callback = callback
        self._stopped = False

    def export(self, batch: Sequence[TelemetryRecord]) -> ExportResult:
        if self._stopped:
            return ExportResult.FAILURE
        self._callback(batch)
        return ExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True

    def shutdown(self) -> None:
        self._stopped = True


class InMemoryExporter(CallbackExporter):
    """Keeps every exported record in a list; the twin used by unit tests."""

    def __init__(self) -> None:
        self._records: list[TelemetryRecord] = []
        super().__init__(self._records.extend)  # one extend per batch: atomic under the GIL

    @property
    def records(self) -> list[TelemetryRecord]:
        return list(self._records)
