"""The ready-made telemetry sink for `vllm serve`: OTLP to an OpenTelemetry Collector, or Kafka directly.

Point the plugin at it (see docs/DEPLOY.md)::

    SPECWATCH_VLLM_SINK=specwatch.collectors.vllm.sink:telemetry_sink
    OTEL_EXPORTER_OTLP_ENDPOINT=http://otelcol:4318

``SPECWATCH_EXPORTER`` (``otlp`` or ``kafka``) chooses the exporter; unset, an
``OTEL_EXPORTER_OTLP_[LOGS_]ENDPOINT`` means OTLP, ``SPECWATCH_KAFKA_BOOTSTRAP`` alone means
Kafka (`specwatch.collectors.otlp_export.exporter_choice`). The engine thread only queues.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

__all__ = ["telemetry_sink", "kafka_telemetry_sink"]


def _emitter(environ: Mapping[str, str] | None, exporter: str | None) -> Any:
    from specwatch.collectors.otel import TelemetryEmitter
    from specwatch.collectors.otlp_export import EXPORTER_VARIABLE, service_instance_id, telemetry_exporter_from_env

    environ = dict(os.environ if environ is None else environ)
    if exporter:
        environ[EXPORTER_VARIABLE] = exporter
    # One spool directory per engine worker, so that a restarted engine finds what it left.
    worker = (environ.get("SPECWATCH_VLLM_WORKER") or "").strip() or service_instance_id() or "engine"
    # The direct path: the same records and bytes as through the OpenTelemetry SDK, without the
    # SDK's per-element attribute cleaning (about 25 us per 16-request step; docs/DEPLOY.md).
    return TelemetryEmitter(telemetry_exporter_from_env(environ, client_id="specwatch-vllm",
                                                        spool_name=f"vllm-{worker}"), sdk=False)


def telemetry_sink(environ: Mapping[str, str] | None = None) -> Any:
    """A `TelemetryEmitter` to the exporter ``SPECWATCH_EXPORTER`` chooses; its ``emit`` never blocks."""
    return _emitter(environ, None)


def kafka_telemetry_sink(environ: Mapping[str, str] | None = None) -> Any:
    """A `TelemetryEmitter` to the telemetry topic through specwatch's Kafka exporter and its spool."""
    return _emitter(environ, "kafka")
