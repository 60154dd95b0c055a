"""The OTel emitter: bounded and never blocking, drops counted, same records and bytes either path."""

from __future__ import annotations

import logging
import threading

import pytest
from opentelemetry.exporter.otlp.proto.common._log_encoder import encode_logs
from opentelemetry.sdk._logs import LogRecordProcessor
from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter, SimpleLogRecordProcessor

from specwatch.collectors.export import InMemoryExporter
from specwatch.collectors.otel import BoundedLogRecordProcessor, TelemetryEmitter
from specwatch.transport.telemetry_exporter import KafkaTelemetryExporter
from specwatch.transport.config import KafkaConfig
from specwatch.transport.topics import TELEMETRY_TOPIC
from specwatch.schemas import RequestRecord, Sample, Sampling, ShadowRecord
from specwatch.schemas.otlp import decode_request

from machine import free_port, until
from telemetry_log import MemoryProducer, step_record

SDK_AND_DIRECT = pytest.mark.parametrize("sdk", [True, False], ids=["sdk", "direct"])


def _mixed() -> list:
    return [
        step_record("w1", 1),
        RequestRecord(v=1, ts=2.0, worker="w1", bundle_id="b-1", id="r1", bucket="coding", cohort="canary",
                      speculative=True, ttft_ms=90.0, tpot_ms=None, e2e_ms=900.0, output_tokens=1,
                      finish_reason="stop", sample=Sample(sampling=Sampling(seed=3))),
        ShadowRecord(v=1, ts=3.0, bundle_id="b-1", id="r1", bucket="coding", check="token_exact", match=True),
        step_record("w2", 2),
    ]


class _HangingExporter(InMemoryExporter):
    """Blocks in export until released, as a wedged network call would."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.entered = threading.Event()

    def export(self, batch):
        self.entered.set()
        self.release.wait(30)
        return super().export(batch)

    def shutdown(self) -> None:
        self.release.set()


@SDK_AND_DIRECT
def test_records_reach_the_in_process_exporter_unchanged(sdk):
    sink = InMemoryExporter()
    records = _mixed()
    with TelemetryEmitter(sink, sdk=sdk) as emitter:
        assert all(emitter.emit(r) for r in records)
        assert emitter.force_flush(5_000)
        assert emitter.stats().exported == len(records)
    assert sink.records == records


@SDK_AND_DIRECT
def test_a_hanging_exporter_never_blocks_emit_and_overflow_is_counted(sdk):
    exporter = _HangingExporter()
    emitter = TelemetryEmitter(exporter, sdk=sdk, max_queue_size=100, max_batch_size=10,
                               schedule_delay_millis=10, shutdown_timeout_millis=100)
    emitter.emit(step_record("w1", 0))
    assert exporter.entered.wait(5)  # the export thread is now stuck inside export()
    # The exporter stays stuck until released, so an emit that waited on it would never
    # return: finishing at all (the join) is the proof; no wall-clock bound is asserted.
    kept = [1]

    def engine_thread():
        for seq in range(1, 1001):
            kept[0] += emitter.emit(step_record("w1", seq))

    engine = threading.Thread(target=engine_thread, daemon=True)
    engine.start()
    engine.join(60)
    assert not engine.is_alive(), "emit blocked behind the hanging exporter"
    kept = kept[0]
    stats = emitter.stats()
    assert stats.queued == 100
    assert stats.dropped == 1001 - kept == 900
    assert emitter.force_flush(100) is False  # cannot finish while the exporter hangs
    exporter.release.set()
    assert emitter.force_flush(5_000)
    assert emitter.stats().exported == kept
    assert [r.seq for r in exporter.records] == sorted(r.seq for r in exporter.records)
    emitter.shutdown()


def test_shutdown_returns_in_bounded_time_when_the_exporter_hangs():
    class Wedged(_HangingExporter):
        def shutdown(self) -> None:  # a sink that ignores shutdown, too
            pass

    exporter = Wedged()
    emitter = TelemetryEmitter(exporter, sdk=False, schedule_delay_millis=10, shutdown_timeout_millis=200)
    emitter.emit(step_record("w1", 0))
    assert exporter.entered.wait(5)
    closer = threading.Thread(target=emitter.shutdown, daemon=True)
    closer.start()
    closer.join(60)  # the sink never returns: only a bounded shutdown can finish
    assert not closer.is_alive(), "shutdown waited on the wedged exporter"
    assert emitter.emit(step_record("w1", 1)) is False  # closed: refused, and counted
    exporter.release.set()


def test_drops_are_reported_by_a_periodic_warning(caplog):
    exporter = _HangingExporter()
    emitter = TelemetryEmitter(exporter, sdk=False, max_queue_size=5, max_batch_size=5, schedule_delay_millis=10,
                               drop_warning_interval_s=0.05, shutdown_timeout_millis=100)
    with caplog.at_level(logging.WARNING, logger="specwatch.collectors.otel"):
        for seq in range(50):
            emitter.emit(step_record("w1", seq))
        exporter.release.set()
        until(lambda: "dropped" in caplog.text, 5, 0.02)
    assert "queue full, dropped" in caplog.text
    emitter.shutdown()


def test_an_exporter_that_raises_counts_failures_and_keeps_exporting():
    calls = []

    class Flaky(InMemoryExporter):
        def export(self, batch):
            calls.append(len(batch))
            if len(calls) == 1:
                raise ConnectionError("sink went away")
            return super().export(batch)

    sink = Flaky()
    with TelemetryEmitter(sink, sdk=False, max_batch_size=3) as emitter:
        for seq in range(3):
            emitter.emit(step_record("w1", seq))
        emitter.force_flush(5_000)
        for seq in range(3, 6):
            emitter.emit(step_record("w1", seq))
        emitter.force_flush(5_000)
        stats = emitter.stats()
    assert (stats.failed, stats.exported) == (3, 3)
    assert [r.seq for r in sink.records] == [3, 4, 5]


def test_sdk_and_direct_paths_write_the_same_kafka_bytes():
    payloads = {}
    for sdk in (True, False):
        producer = MemoryProducer()
        exporter = KafkaTelemetryExporter(KafkaConfig("127.0.0.1:9", topic="t"), producer=producer)
        with TelemetryEmitter(exporter, sdk=sdk) as emitter:
            for record in _mixed():
                emitter.emit(record)
            assert emitter.force_flush(5_000)
        payloads[sdk] = producer.sent
    assert payloads[True] == payloads[False]
    keys = [key for _, key, _ in payloads[True]]
    assert keys == [b"w1", b"b-1", b"w2"]  # one message per key; shadows keyed by bundle
    decoded = [r for _, _, value in payloads[True] for r in decode_request(value)]
    assert sorted(decoded, key=lambda r: r.ts) == sorted(_mixed(), key=lambda r: r.ts)


def test_the_sdk_path_is_plain_opentelemetry_to_other_processors():
    """Records emitted through the SDK encode with OTel's own OTLP encoder and decode back."""
    otel_sink = InMemoryLogRecordExporter()
    emitter = TelemetryEmitter(InMemoryExporter(), sdk=True)
    emitter.provider.add_log_record_processor(SimpleLogRecordProcessor(otel_sink))
    for record in _mixed():
        emitter.emit(record)
    emitter.shutdown()
    data = encode_logs(otel_sink.get_finished_logs()).SerializeToString()
    assert decode_request(data) == _mixed()


def test_foreign_log_records_are_left_alone():
    sink = InMemoryExporter()
    emitter = TelemetryEmitter(sink, sdk=True)
    emitter.provider.get_logger("app").emit(body="user logged in", event_name="app.login")
    emitter.emit(step_record("w1", 1))
    emitter.force_flush(5_000)
    emitter.shutdown()
    assert sink.records == [step_record("w1", 1)]
    assert emitter.stats().rejected == 0


def test_processor_settings_are_validated():
    with pytest.raises(ValueError, match="max_batch_size"):
        BoundedLogRecordProcessor(InMemoryExporter(), max_queue_size=10, max_batch_size=20)
    with pytest.raises(ValueError, match="max_queue_size"):
        TelemetryEmitter(InMemoryExporter(), sdk=False, max_queue_size=0)
    assert isinstance(BoundedLogRecordProcessor(InMemoryExporter()), LogRecordProcessor)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"bootstrap_servers": "localhost"}, "HOST:PORT"),
        ({"compression_type": "brotli"}, "compression_type"),
        ({"security_protocol": "SASL_SSL"}, "sasl_mechanism"),
        ({"security_protocol": "SASL_SSL", "sasl_mechanism": "SCRAM-SHA-512", "sasl_username": "u"},
         "sasl_password"),
        ({"linger_ms": -1}, "linger_ms"),
    ],
)
def test_kafka_config_says_what_to_fix(settings, message):
    with pytest.raises(ValueError, match=message):
        KafkaConfig(**{"bootstrap_servers": "127.0.0.1:9092", **settings})


@SDK_AND_DIRECT
def test_a_down_broker_only_counts_failures(sdk):
    config = KafkaConfig(f"127.0.0.1:{free_port()}", topic=TELEMETRY_TOPIC, max_block_ms=200,
                         request_timeout_ms=500, delivery_timeout_ms=1_000)
    exporter = KafkaTelemetryExporter(config)  # api_version is set: no bootstrap round trip here
    emitter = TelemetryEmitter(exporter, sdk=sdk, schedule_delay_millis=20,
                               shutdown_timeout_millis=2_000)
    # queued, never sent on this thread
    assert all(emitter.emit(step_record("w1", seq)) for seq in range(200))
    until(lambda: emitter.stats().failed >= 200, 10)
    stats = emitter.stats()
    assert stats.failed + stats.dropped == 200 and stats.exported == 0
    assert exporter.stats()["records_failed"] == stats.failed
    emitter.shutdown()
