"""The in-process telemetry sinks: a function in the same process, and memory (unit tests).
The interface they implement, `ExportResult` and `TelemetryExporter`, is `specwatch.schemas.exporter`.
"""

from __future__ import annotations

from typing import Sequence

from specwatch.schemas import TelemetryRecord
from specwatch.schemas.exporter import ExportResult, TelemetryExporter

__all__ = ["ExportResult", "TelemetryExporter", "InMemoryExporter", "CallbackExporter"]


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
