"""The one exporter interface every telemetry sink implements (Kafka, in-process, memory).

Batching lives in the provider, not in sinks: a sink only moves a batch somewhere.
"""

from __future__ import annotations

import enum
from typing import Protocol, Sequence

from .contract import TelemetryRecord

__all__ = ["ExportResult", "TelemetryExporter"]


class ExportResult(enum.Enum):
    SUCCESS = 0
    FAILURE = 1


class TelemetryExporter(Protocol):
    """Where contract-v1 records go. Must never block the engine for long."""

    def export(self, batch: Sequence[TelemetryRecord]) -> ExportResult: ...

    def force_flush(self, timeout_millis: int = 30_000) -> bool: ...

    def shutdown(self) -> None: ...
