"""OTLP export from the engines through OpenTelemetry's exporters (the real Collector: tests/test_otelcol.py)."""

from __future__ import annotations

import threading

import pytest
from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter
from opentelemetry.sdk.resources import Resource

from specwatch.collectors.otel import TelemetryEmitter
from specwatch.transport.telemetry_exporter import KafkaTelemetryExporter
from specwatch.collectors.otlp_export import (OtlpTelemetryExporter, otlp_log_exporter,
                                              resource_from_env, service_instance_id,
                                              telemetry_exporter_from_env)
from specwatch.lab.simulation.simulator import Simulator
from specwatch.cli import main
from specwatch.schemas import encode_record
from specwatch.schemas.otlp import decode_request

from machine import free_port


def test_records_round_trip_through_the_standard_encoder_with_one_resource_per_worker():
    records = list(Simulator("bundle_change", seed=5, minutes=0.2, workers=3).records())
    memory = InMemoryLogRecordExporter()
    exporter = OtlpTelemetryExporter(memory, resource=Resource({"service.name": "engine", "team": "serving"}))
    assert exporter.export(records).name == "SUCCESS"
    payload = encode_logs(memory.get_finished_logs()).SerializeToString()
    decoded = decode_request(payload)
    assert sorted(map(encode_record, decoded)) == sorted(map(encode_record, records))  # exactly, no rejection
    resources = {}
    for resource_logs in ExportLogsServiceRequest.FromString(payload).resource_logs:
        attributes = {kv.key: kv.value.string_value for kv in resource_logs.resource.attributes}
        workers = {r.worker for r in decode_request(ExportLogsServiceRequest(resource_logs=[resource_logs])
                                                    .SerializeToString()) if r.kind != "shadow"}
        resources[attributes.get("service.instance.id")] = (workers, attributes["team"])
    assert resources == {"w1": ({"w1"}, "serving"), "w2": ({"w2"}, "serving"), "w3": ({"w3"}, "serving"),
                         None: (set(), "serving")}  # shadow records: the process's resource
    assert exporter.stats() == {"requests": 1, "records": len(records), "failed_requests": 0, "records_failed": 0}


def test_protocols_and_resources_come_from_the_standard_variables(monkeypatch):
    from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter as GrpcExporter
    from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter as HttpExporter

    for name in ("OTEL_RESOURCE_ATTRIBUTES", "OTEL_SERVICE_NAME", "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    exporter = otlp_log_exporter({})
    assert isinstance(exporter, HttpExporter) and exporter._endpoint == "http://127.0.0.1:4318/v1/logs"
    exporter.shutdown()
    exporter = otlp_log_exporter({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                                  "OTEL_EXPORTER_OTLP_LOGS_PROTOCOL": "grpc"})  # the logs variant wins
    assert isinstance(exporter, GrpcExporter)
    exporter.shutdown()
    exporter = otlp_log_exporter({}, endpoint="http://collector:4318/")
    assert exporter._endpoint == "http://collector:4318/v1/logs"  # a base endpoint, as the variable is
    exporter.shutdown()
    with pytest.raises(ValueError, match="must be http/protobuf or grpc .* got 'http/json'"):
        otlp_log_exporter({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})

    assert service_instance_id() is None and resource_from_env().attributes["service.name"] == "specwatch"
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.instance.id=gpu-7,deployment.environment=prod")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "serving")
    assert service_instance_id() == "gpu-7"
    assert resource_from_env().attributes["service.name"] == "serving"

    otlp = telemetry_exporter_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"})
    assert isinstance(otlp, OtlpTelemetryExporter)
    otlp.shutdown()


def test_the_kafka_choice_builds_the_direct_exporter_with_its_spool(tmp_path):
    kafka = telemetry_exporter_from_env({"SPECWATCH_KAFKA_BOOTSTRAP": "127.0.0.1:9",
                                         "SPECWATCH_TELEMETRY_TOPIC": "t.telemetry",
                                         "SPECWATCH_TELEMETRY_SPOOL_DIR": str(tmp_path / "spool")})
    try:
        assert isinstance(kafka, KafkaTelemetryExporter) and kafka.config.topic == "t.telemetry"
        assert (tmp_path / "spool" / ".lock").exists()
    finally:
        kafka.shutdown(timeout_millis=0)


def test_a_collector_that_is_away_costs_counted_records_never_the_engine():
    from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter

    away = free_port()
    exporter = OtlpTelemetryExporter(OTLPLogExporter(endpoint=f"http://127.0.0.1:{away}/v1/logs", timeout=0.5))
    emitter = TelemetryEmitter(exporter, sdk=False, max_queue_size=100, max_batch_size=50,
                               schedule_delay_millis=10)
    steps = [r for r in Simulator("healthy", seed=3, minutes=0.2, workers=1).records() if r.kind == "step"][:400]
    kept = []
    engine = threading.Thread(target=lambda: kept.extend(emitter.emit(step) for step in steps))
    engine.start()
    engine.join(60)
    assert not engine.is_alive()  # no emit waited for the Collector
    emitter.force_flush(30_000)
    emitter.shutdown()
    stats, emitted = emitter.stats(), exporter.stats()
    assert stats.dropped == kept.count(False) and stats.exported == 0
    assert emitted["records"] == 0 and emitted["records_failed"] == stats.failed == kept.count(True)
    assert stats.failed + stats.dropped == len(steps)  # every record accounted for


def test_simulate_takes_one_destination(capsys):
    assert main(["simulate", "--output", "x.jsonl", "--otlp"]) == 2
    assert "give --output FILE or --bootstrap HOST:PORT or --otlp [ENDPOINT], one of them" in capsys.readouterr().err


def test_simulate_to_a_collector_that_is_away_says_so_and_fails(capsys, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "0.5")
    away = f"http://127.0.0.1:{free_port()}"
    assert main(["simulate", "--otlp", away, "--scenario", "healthy", "--minutes", "0.02", "--workers", "1"]) == 1
    err = capsys.readouterr().err
    assert f"records were not delivered to {away}" in err and "is a Collector listening there?" in err


def test_headers_compression_and_the_logs_endpoint_come_from_the_standard_variables(monkeypatch):
    """A plain OTLP/HTTP endpoint records what arrives: the variables alone shape the requests."""
    import gzip
    import http.server

    seen = []

    class Endpoint(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Endpoint)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")  # the logs variant wins
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT", f"http://127.0.0.1:{server.server_port}/ingest/logs")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-team=serving,authorization=Bearer%20t0ken")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")
        monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=canary")
        records = [r for r in Simulator("healthy", seed=2, minutes=0.05, workers=2).records()]
        exporter = telemetry_exporter_from_env({"OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": "set",
                                                "SPECWATCH_KAFKA_BOOTSTRAP": "k:9092"})
        assert exporter.export(records).name == "SUCCESS"
        exporter.shutdown()
    finally:
        server.shutdown()
    ((path, headers, body),) = seen
    assert path == "/ingest/logs"
    assert headers["x-team"] == "serving" and headers["authorization"] == "Bearer t0ken"
    assert headers["content-encoding"] == "gzip" and headers["content-type"] == "application/x-protobuf"
    payload = gzip.decompress(body)
    assert sorted(map(encode_record, decode_request(payload))) == sorted(map(encode_record, records))
    environments = {kv.value.string_value for rl in ExportLogsServiceRequest.FromString(payload).resource_logs
                    for kv in rl.resource.attributes if kv.key == "deployment.environment"}
    assert environments == {"canary"}
