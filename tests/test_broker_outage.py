"""A Kafka outage seen from the engine side, on a real broker this test starts and stops itself.

While the broker is gone, a simulated worker keeps emitting through TelemetryEmitter and
KafkaTelemetryExporter: no emit blocks (the worker finishes: that is the proof), and every
record is accounted for as exported, dropped or failed. After the broker is back, records
emitted from then on arrive, in order.

The broker runs on its own port (and so its own data directory) so that the shared test
broker and colleagues' runs never notice; `broker.sh start` formats fresh storage, so the
restarted broker is a new, empty cluster, which is harder on clients than a restart of
the same one.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
from kafka import KafkaConsumer, TopicPartition

from specwatch.collectors.otel import KafkaConfig, KafkaTelemetryExporter, TelemetryEmitter
from specwatch.schemas import RoundEntry, StepRecord
from specwatch.schemas.otlp import decode_request

from own_broker import OwnBroker

pytestmark = pytest.mark.kafka

_PORT = int(os.environ.get("SPECWATCH_OUTAGE_KAFKA_PORT", "19392"))
_broker = OwnBroker(_PORT, partitions=2)
_TOPIC = "specwatch.telemetry"
_PATIENCE_S = 120.0  # liveness deadline on a busy shared machine, not a performance bound


@pytest.fixture
def own_broker():
    with _broker.running() as address:
        yield address


def _step(worker: str, seq: int) -> StepRecord:
    return StepRecord(v=1, ts=1_000.0 + seq * 0.02, worker=worker, seq=seq, bundle_id="b-1", draft_ms=0.8,
                      verify_ms=10.0, kv_usage=0.5,
                      requests=[RoundEntry(id=f"{worker}-{seq}-{i}", bucket="coding", cohort="main", drafted=4,
                                           accepted=seq % 5) for i in range(8)])


def _engine(emitter: TelemetryEmitter, worker: str, count: int) -> tuple[threading.Thread, list[int]]:
    kept = [0]

    def run() -> None:
        for seq in range(count):
            kept[0] += emitter.emit(_step(worker, seq))

    thread = threading.Thread(target=run, name=f"engine-{worker}", daemon=True)
    thread.start()
    return thread, kept


def _until(condition) -> bool:
    deadline = time.monotonic() + _PATIENCE_S
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _records_of(address: str, worker: str, expected: int, patience_s: float = _PATIENCE_S) -> list[StepRecord]:
    consumer = KafkaConsumer(bootstrap_servers=address, api_version=(4, 0), group_id=None,
                             enable_auto_commit=False, auto_offset_reset="earliest")
    try:
        partitions = [TopicPartition(_TOPIC, p) for p in sorted(consumer.partitions_for_topic(_TOPIC))]
        consumer.assign(partitions)
        consumer.seek_to_beginning(*partitions)
        found: list[StepRecord] = []
        deadline = time.monotonic() + patience_s
        while len(found) < expected and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500).values():
                for message in batch:
                    found.extend(r for r in decode_request(message.value) if getattr(r, "worker", None) == worker)
        return found
    finally:
        consumer.close()


def test_emits_never_block_while_the_broker_is_down_and_flow_resumes_after(own_broker, capsys):
    # The default max_block_ms: a fresh broker's first metadata answer can take longer than a
    # short bound on a busy machine. Waits happen on the export thread either way.
    config = KafkaConfig(own_broker, topic=_TOPIC, request_timeout_ms=1_000, delivery_timeout_ms=3_000)
    exporter = KafkaTelemetryExporter(config)
    emitter = TelemetryEmitter(exporter, sdk=False, max_queue_size=2_000, max_batch_size=500,
                               schedule_delay_millis=20, shutdown_timeout_millis=5_000)
    before, during, after = 500, 6_000, 800
    try:
        engine, kept = _engine(emitter, "w-before", before)
        engine.join(_PATIENCE_S)
        assert not engine.is_alive() and kept[0] == before
        assert emitter.force_flush(60_000)
        assert _until(lambda: exporter.stats()["records"] == before), (emitter.stats(), exporter.stats())
        assert len(_records_of(own_broker, "w-before", before)) == before

        messages_before = exporter.stats()["messages"]
        _broker("stop")
        engine, kept = _engine(emitter, "w-during", during)
        engine.join(_PATIENCE_S)  # a blocking emit would hold the worker here for good
        assert not engine.is_alive(), "emit blocked while the broker was down"
        accepted = kept[0]
        dropped = emitter.stats().dropped
        assert dropped == during - accepted  # what the bounded queue could not take is counted
        # Every accepted record was handed to the producer (or failed at the hand-over), and every
        # message handed over while the broker was gone failed on delivery, counted.
        assert _until(lambda: emitter.stats().queued == 0 and emitter.stats().exported + emitter.stats().failed
                      == before + accepted)
        assert _until(lambda: exporter.stats()["delivery_errors"] + exporter.stats()["send_errors"]
                      == exporter.stats()["messages"] - messages_before + exporter.stats()["send_errors"])
        during_stats = dict(exporter.stats())
        assert during_stats["delivery_errors"] > 0
        lost = accepted + dropped  # all of them: the restarted broker is a new, empty cluster

        _broker("start")
        # The producer finds the new cluster by itself; until its metadata is fresh, sends may
        # still fail (and are counted). Probe until one record gets through: that is recovery.
        probes = 0
        deadline = time.monotonic() + _PATIENCE_S
        while time.monotonic() < deadline:
            emitter.emit(_step("w-probe", probes))
            probes += 1
            emitter.force_flush(10_000)
            if _records_of(own_broker, "w-probe", 1, patience_s=3.0):
                break
        else:
            pytest.fail(f"nothing got through in {_PATIENCE_S:.0f} s after the broker came back")
        engine, kept = _engine(emitter, "w-after", after)
        engine.join(_PATIENCE_S)
        assert not engine.is_alive() and kept[0] == after
        arrived = _records_of(own_broker, "w-after", after)
        assert [r.seq for r in arrived] == list(range(after))  # all of them, in order
        assert emitter.force_flush(60_000)
    finally:
        emitter.shutdown()
    with capsys.disabled():
        print(f"\nbroker outage: before={before} delivered; during={during} emitted, {accepted} queued, "
              f"{dropped} dropped at the queue, {during_stats['messages'] - messages_before} messages handed "
              f"to the producer: {during_stats['delivery_errors']} delivery errors, {during_stats['send_errors']} "
              f"send errors; {lost} records lost in all; recovery after {probes} probe(s); after={after} emitted, "
              f"{len(arrived)} arrived in order")


def test_failed_deliveries_count_their_records():
    class Future:
        def add_errback(self, f, *args):
            self.fail = lambda error: f(*args, error)  # what kafka.future.Future does

    class Producer:
        def send(self, *args, **kwargs):
            self.future = Future()
            return self.future

    producer = Producer()
    exporter = KafkaTelemetryExporter(KafkaConfig("127.0.0.1:9"), producer=producer)
    exporter.export([_step("w", 0), _step("w", 1)])
    try:
        producer.future.fail(ConnectionError("broker gone"))
    except TypeError:
        pass  # kafka-python logs and swallows what an errback raises
    assert exporter.stats()["records_failed"] == 2
