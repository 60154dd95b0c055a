"""The export section of `specwatch bench`: this process's CPU per step record through OTLP/HTTP
and through the direct Kafka path (without a broker, its encoding alone)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections import deque
from typing import Any

from specwatch.lab.bench import timed

__all__ = ["run_export_bench"]

_BATCH = 512
# A plain OTLP/HTTP endpoint in a process of its own: reads each request, answers 200.
_SINK = """
import http.server, sys
class Sink(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Sink)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def _cpu_per_step(steps: list, export) -> float:
    batches = [steps[i:i + _BATCH] for i in range(0, len(steps), _BATCH)]
    return timed(lambda: [export(batch) for batch in batches])[0] / len(steps) * 1e6


def run_export_bench(steps: list, bootstrap: str | None) -> dict[str, Any]:
    """Microseconds of this process's CPU per step record: OTLP/HTTP, direct Kafka (or its encoding)."""
    from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter

    from specwatch.transport.telemetry_exporter import KafkaTelemetryExporter
    from specwatch.transport.config import KafkaConfig
    from specwatch.collectors.otlp_export import OtlpTelemetryExporter
    from specwatch.schemas.otlp import iter_encoded_chunks, log_entry

    out: dict[str, Any] = {"steps": len(steps), "batch": _BATCH,
                           "requests_per_step": sum(len(s.requests) for s in steps) / len(steps)}
    sink = subprocess.Popen([sys.executable, "-c", _SINK], stdout=subprocess.PIPE, text=True)
    try:
        port = int(sink.stdout.readline())
        otlp = OtlpTelemetryExporter(OTLPLogExporter(endpoint=f"http://127.0.0.1:{port}/v1/logs", timeout=30))
        out["otlp_http_us_per_step"] = _cpu_per_step(steps, otlp.export)
        out["otlp_http_failed_records"] = otlp.stats()["records_failed"]
        otlp.shutdown()
    finally:
        sink.terminate()
        sink.wait()

    out["kafka_encode_us_per_step"] = _cpu_per_step(
        steps, lambda batch: deque(iter_encoded_chunks([log_entry(s) for s in batch]), maxlen=0))
    if bootstrap:
        kafka = KafkaTelemetryExporter(KafkaConfig(bootstrap, topic=f"swbench-export-{uuid.uuid4().hex[:6]}"))

        def export_and_flush(batch):
            kafka.export(batch)
            kafka.force_flush()

        out["kafka_us_per_step"] = _cpu_per_step(steps, export_and_flush)
        out["kafka_failed_records"] = kafka.stats()["records_failed"]
        kafka.shutdown()
        out["otlp_http_over_kafka"] = out["otlp_http_us_per_step"] / out["kafka_us_per_step"]
    else:
        out["kafka_us_per_step"] = None
        out["note"] = "no --bootstrap: the direct path's figure is its encoding alone"
    out["otlp_http_over_kafka_encode"] = out["otlp_http_us_per_step"] / out["kafka_encode_us_per_step"]
    return out
