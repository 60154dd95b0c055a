"""The ready-made telemetry sink for `vllm serve`: OTLP to an OpenTelemetry Collector, or Kafka directly.

``SPECWATCH_EXPORTER`` chooses (`otlp_export.exporter_choice`); see docs/DEPLOY.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

__all__ = ["telemetry_sink"]


def telemetry_sink(environ: Mapping[str, str] | None = None, exporter: str | None = None) -> Any:
    """A never-blocking `TelemetryEmitter` to ``exporter`` (default: ``SPECWATCH_EXPORTER``'s)."""
    from specwatch.collectors.otel import TelemetryEmitter
    from specwatch.collectors.otlp_export import EXPORTER_VARIABLE, service_instance_id, telemetry_exporter_from_env

    environ = dict(os.environ if environ is None else environ)
    if exporter:
        environ[EXPORTER_VARIABLE] = exporter
    # One spool directory per engine worker, so that a restarted engine finds what it left.
    worker = (environ.get("SPECWATCH_VLLM_WORKER") or "").strip() or service_instance_id() or "engine"
    # The direct path: the SDK's bytes at a fraction of its cost (docs/BENCHMARKS.md).
    return TelemetryEmitter(telemetry_exporter_from_env(environ, client_id="specwatch-vllm",
                                                        spool_name=f"vllm-{worker}"), sdk=False)
