"""Standard OTLP export from the engines: contract records to an OpenTelemetry Collector.

Configured by the standard ``OTEL_*`` variables; ``SPECWATCH_EXPORTER`` picks it or direct Kafka.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry._logs import LogRecord
from opentelemetry.sdk._logs import ReadableLogRecord
from opentelemetry.sdk._logs.export import LogRecordExporter, LogRecordExportResult
from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, OTELResourceDetector, Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from specwatch.collectors.export import ExportResult
from specwatch.schemas import CONTRACT_VERSION, TelemetryRecord
from specwatch.schemas.otlp import LogEntry, log_entry

__all__ = ["EXPORTER_VARIABLE", "EXPORTERS", "OtlpTelemetryExporter", "exporter_choice",
           "otlp_log_exporter", "resource_from_env", "service_instance_id",
           "telemetry_exporter_from_env"]

logger = logging.getLogger(__name__)

EXPORTER_VARIABLE = "SPECWATCH_EXPORTER"
EXPORTERS = ("otlp", "kafka")
_DEFAULT_SERVICE_NAME = "specwatch"
_SCOPE = InstrumentationScope("specwatch", str(CONTRACT_VERSION))
# The protocols OpenTelemetry's Python exporters speak; the specification's default first.
_PROTOCOLS = ("http/protobuf", "grpc")
_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
_PROTOCOL_VARIABLES = ("OTEL_EXPORTER_OTLP_LOGS_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")


def exporter_choice(environ: Mapping[str, str] | None = None) -> str:
    """Which exporter the environment asks for: ``otlp`` or ``kafka`` (docs/DEPLOY.md, 2a).

    >>> exporter_choice({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://otelcol:4318",
    ...                  "SPECWATCH_KAFKA_BOOTSTRAP": "k:9092"})
    'otlp'
    >>> exporter_choice({"SPECWATCH_KAFKA_BOOTSTRAP": "k:9092"}), exporter_choice({})
    ('kafka', 'otlp')
    >>> exporter_choice({"OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": "http://c:4318/v1/logs",
    ...                  "SPECWATCH_KAFKA_BOOTSTRAP": "k:9092"})
    'otlp'
    >>> exporter_choice({"SPECWATCH_EXPORTER": "KAFKA", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"})
    'kafka'
    >>> exporter_choice({"SPECWATCH_EXPORTER": "zipkin"})
    Traceback (most recent call last):
    ...
    ValueError: SPECWATCH_EXPORTER must be otlp or kafka, got 'zipkin'
    """
    environ = os.environ if environ is None else environ
    chosen = (environ.get(EXPORTER_VARIABLE) or "").strip().lower()
    if chosen:
        if chosen not in EXPORTERS:
            raise ValueError(f"{EXPORTER_VARIABLE} must be {' or '.join(EXPORTERS)}, "
                             f"got {environ.get(EXPORTER_VARIABLE)!r}")
        return chosen
    if any(environ.get(name) for name in _ENDPOINT_VARIABLES):
        return "otlp"
    if environ.get("SPECWATCH_KAFKA_BOOTSTRAP"):
        return "kafka"
    return "otlp"


def resource_from_env(service_name: str = _DEFAULT_SERVICE_NAME) -> Resource:
    """The process's resource: ``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_SERVICE_NAME``, else ``service.name``."""
    resource = Resource.create({})
    if resource.attributes.get(SERVICE_NAME, "").startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service_name}))
    return resource


def service_instance_id() -> str | None:
    """``service.instance.id`` as ``OTEL_RESOURCE_ATTRIBUTES`` sets it (the SDK's random default does not count)."""
    value = OTELResourceDetector().detect().attributes.get(SERVICE_INSTANCE_ID)
    return str(value) if value else None


def otlp_log_exporter(environ: Mapping[str, str] | None = None, *, endpoint: str | None = None) -> LogRecordExporter:
    """OpenTelemetry's OTLP log exporter for ``OTEL_EXPORTER_OTLP_[LOGS_]PROTOCOL``.

    It reads the other ``OTEL_EXPORTER_OTLP_*`` variables itself; ``endpoint`` replaces the base.
    """
    environ = os.environ if environ is None else environ
    protocol = next((environ[name].strip() for name in _PROTOCOL_VARIABLES if environ.get(name)), _PROTOCOLS[0])
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter

        return OTLPLogExporter(endpoint=f"{endpoint.rstrip('/')}/v1/logs" if endpoint else None)
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter

        return OTLPLogExporter(endpoint=endpoint or None)
    raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL must be {' or '.join(_PROTOCOLS)} "
                     f"(http/json is not offered by OpenTelemetry's Python exporters), got {protocol!r}")


class OtlpTelemetryExporter:
    """Contract records through an OpenTelemetry OTLP log exporter (to a Collector).

    The resource is ``resource`` (default `resource_from_env()`) plus ``service.instance.id`` =
    the record's worker, so a Collector keying by resource keeps each worker on one partition.

    >>> from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter
    >>> from specwatch.schemas import ShadowRecord
    >>> memory = InMemoryLogRecordExporter()
    >>> exporter = OtlpTelemetryExporter(memory, resource=Resource({"service.name": "engine"}))
    >>> exporter.export([ShadowRecord(v=1, ts=1.5, bundle_id="b-1", id="r9", bucket="structured",
    ...                               check="token_exact", match=False)]).name
    'SUCCESS'
    >>> [(r.log_record.event_name, r.resource.attributes["service.name"]) for r in memory.get_finished_logs()]
    [('specwatch.shadow', 'engine')]
    >>> exporter.stats()["records"]
    1
    """

    def __init__(self, log_exporter: LogRecordExporter, *, resource: Resource | None = None) -> None:
        self._exporter = log_exporter
        self._resource = resource_from_env() if resource is None else resource
        self._by_worker: dict[str, Resource] = {}
        self._lock = threading.Lock()
        self._counts: collections.Counter = collections.Counter()

    def _resource_of(self, worker: Any) -> Resource:
        if not worker:
            return self._resource  # shadow records come from a judge, not a worker
        resource = self._by_worker.get(worker)
        if resource is None:
            resource = self._by_worker[worker] = self._resource.merge(Resource({SERVICE_INSTANCE_ID: worker}))
        return resource

    def export(self, batch: Sequence[TelemetryRecord]) -> ExportResult:
        return self.export_entries([log_entry(record) for record in batch])

    def export_entries(self, entries: Sequence[LogEntry]) -> ExportResult:
        """The same as `export`, for records already in their OTLP form (the SDK path)."""
        if not entries:
            return ExportResult.SUCCESS
        readables = [ReadableLogRecord(
            LogRecord(timestamp=entry.time_unix_nano, observed_timestamp=entry.time_unix_nano,
                      attributes=entry.attributes, event_name=entry.event_name),
            resource=self._resource_of(entry.attributes.get("specwatch.worker")), instrumentation_scope=_SCOPE)
            for entry in entries]
        try:
            result = self._exporter.export(readables)
        except Exception as error:  # noqa: BLE001 - an exporter that raises must not stop the export thread
            logger.debug("OTLP export of %d records raised: %s", len(entries), error)
            result = LogRecordExportResult.FAILURE
        with self._lock:
            if result is LogRecordExportResult.SUCCESS:
                self._counts.update(requests=1, records=len(entries))
            else:
                self._counts.update(failed_requests=1, records_failed=len(entries))
        return ExportResult.SUCCESS if result is LogRecordExportResult.SUCCESS else ExportResult.FAILURE

    def stats(self) -> dict[str, int]:
        """requests and records the endpoint accepted; failed requests and their records."""
        with self._lock:
            return {name: self._counts.get(name, 0) for name in
                    ("requests", "records", "failed_requests", "records_failed")}

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return bool(self._exporter.force_flush(timeout_millis))

    def shutdown(self) -> None:
        self._exporter.shutdown()


def telemetry_exporter_from_env(environ: Mapping[str, str] | None = None, *, client_id: str = "specwatch",
                                topic: str | None = None, spool_name: str | None = None) -> Any:
    """The telemetry exporter `exporter_choice` names, configured from the environment.

    ``kafka`` comes with its on-disk spool; ``spool_name`` names the spool's default directory.
    """
    environ = os.environ if environ is None else environ
    if exporter_choice(environ) == "otlp":
        return OtlpTelemetryExporter(otlp_log_exporter(environ))
    from specwatch.transport.telemetry_exporter import KafkaTelemetryExporter
    from specwatch.transport.config import KafkaConfig
    from specwatch.transport.telemetry_spool import TelemetrySpool

    topic = topic or environ.get("SPECWATCH_TELEMETRY_TOPIC") or None
    config = KafkaConfig.from_env(environ=environ, client_id=client_id, **({"topic": topic} if topic else {}))
    return KafkaTelemetryExporter(config, spool=TelemetrySpool.from_env(environ, name=spool_name or client_id))
