"""A Kafka outage seen from the engine side, on a broker of the test's own ports that it stops and
starts; restarted on fresh storage, it is a new, empty cluster."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid

import pytest

from specwatch.lab.bench.broker import OwnBroker, forget_broker_data, port_from_env
from specwatch.collectors.otel import TelemetryEmitter
from specwatch.transport.telemetry_exporter import KafkaTelemetryExporter
from specwatch.transport.config import KafkaConfig
from specwatch.transport.topics import TELEMETRY_TOPIC
from specwatch.transport.telemetry_spool import TelemetrySpool
from specwatch.schemas import StepRecord
from specwatch.schemas.otlp import decode_request

from kafka_helpers import topic_messages
from machine import free_port, until
from telemetry_log import step_record as _step

pytestmark = pytest.mark.kafka


_PORT, _PORT_OF_THIS_RUN = port_from_env("SPECWATCH_OUTAGE_KAFKA_PORT")
_broker = OwnBroker(_PORT, partitions=2)
_TOPIC = TELEMETRY_TOPIC
_PATIENCE_S = 120.0  # liveness deadline on a busy shared machine, not a performance bound


@pytest.fixture
def own_broker():
    with _broker.running() as address:
        yield address
    if _PORT_OF_THIS_RUN:  # leave nothing behind
        forget_broker_data(_PORT)


def _engine(emitter: TelemetryEmitter, worker: str, count: int) -> None:
    """``worker`` emits ``count`` steps on a thread of its own; every one is kept, none blocks."""
    kept = [0]

    def run() -> None:
        for seq in range(count):
            kept[0] += emitter.emit(_step(worker, seq))

    thread = threading.Thread(target=run, name=f"engine-{worker}", daemon=True)
    thread.start()
    thread.join(_PATIENCE_S)  # a blocking emit would hold the worker here for good
    assert not thread.is_alive(), f"emit blocked ({worker})"
    assert kept[0] == count


def _records_of(address: str, worker: str, topic: str = _TOPIC) -> list[StepRecord]:
    """``worker``'s records on ``topic``, as far as the broker has acknowledged them."""
    return [r for message in topic_messages(address, topic) for r in decode_request(message.value)
            if getattr(r, "worker", None) == worker]


def test_nothing_is_lost_in_an_outage_shorter_than_the_spools_limits(own_broker, tmp_path, capsys):
    # The default max_block_ms: a fresh broker's first metadata answer can take longer than a
    # short bound on a busy machine. Waits happen on the export thread either way.
    config = KafkaConfig(own_broker, topic=_TOPIC, request_timeout_ms=1_000, delivery_timeout_ms=3_000)
    spool = TelemetrySpool(tmp_path / "spool")
    exporter = KafkaTelemetryExporter(config, spool=spool, drain_backoff_s=(0.2, 2.0))
    emitter = TelemetryEmitter(exporter, sdk=False, max_batch_size=500, schedule_delay_millis=20,
                               shutdown_timeout_millis=5_000)
    before, during, after = 500, 6_000, 800
    try:
        _engine(emitter, "w-before", before)
        assert emitter.force_flush(60_000)
        assert len(_records_of(own_broker, "w-before")) == before

        _broker("stop")
        _engine(emitter, "w-during", during)
        assert emitter.stats().dropped == 0
        # Everything the broker could not take waits on disk, the failed deliveries included.
        assert until(lambda: exporter.stats()["spool_pending"] == during, _PATIENCE_S), (emitter.stats(), exporter.stats())
        during_stats = dict(exporter.stats())

        _broker("start")  # a new, empty cluster
        assert until(lambda: exporter.force_flush(5_000), _PATIENCE_S), exporter.stats()
        _engine(emitter, "w-after", after)
        assert emitter.force_flush(60_000)
        spooled = _records_of(own_broker, "w-during")
        arrived = _records_of(own_broker, "w-after")
    finally:
        emitter.shutdown()
    stats = exporter.stats()
    assert [r.seq for r in spooled] == list(range(during))  # all of them, once, in order: 0 lost of 6,000
    assert [r.seq for r in arrived] == list(range(after))
    assert stats["records_failed"] == 0 and stats["spool_pending"] == 0
    assert (stats["spooled"], stats["drained"]) == (during, during)
    assert (stats["spool_dropped_full"], stats["spool_dropped_expired"], stats["spool_corrupt_frames"]) == (0, 0, 0)
    with capsys.disabled():
        print(f"\nbroker outage: before={before} delivered; during={during} emitted, 0 dropped at the queue, "
              f"{during_stats['delivery_errors']} delivery errors and {during_stats['send_errors']} send errors, "
              f"{stats['spooled']} records spooled; after the broker came back ({stats['producer_renewals']} "
              f"producer renewals) {len(spooled)} of {during} arrived once, in order (0 lost); after={after} "
              f"emitted, {len(arrived)} arrived in order")


_SPOOLING_PROCESS = """
import sys
from specwatch.transport.telemetry_exporter import KafkaTelemetryExporter
from specwatch.transport.config import KafkaConfig
from specwatch.transport.telemetry_spool import TelemetrySpool
from telemetry_log import step_record as _step

address, directory, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
exporter = KafkaTelemetryExporter(KafkaConfig(address, max_block_ms=500), spool=TelemetrySpool(directory))
for start in range(0, count, 100):
    exporter.export([_step("w-restart", seq) for seq in range(start, min(start + 100, count))])
exporter.shutdown()
print(exporter.stats()["spooled"], exporter.stats()["spool_pending"])
"""


def test_the_spool_outlives_its_process_and_the_next_one_drains_it_in_order(kafka_bootstrap, tmp_path):
    from kafka.admin import KafkaAdminClient, NewTopic

    count = 1_500
    away = f"127.0.0.1:{free_port()}"
    done = subprocess.run([sys.executable, "-c", _SPOOLING_PROCESS, away, str(tmp_path / "spool"), str(count)],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=os.path.dirname(__file__)))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [str(count), str(count)]  # all spooled, all still pending at exit

    topic = f"test.spool.{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap, api_version=(4, 0))
    admin.create_topics([NewTopic(topic, 2, 1)])
    try:
        exporter = KafkaTelemetryExporter(KafkaConfig(kafka_bootstrap, topic=topic),
                                          spool=TelemetrySpool(tmp_path / "spool"), drain_backoff_s=(0.2, 2.0))
        try:
            assert exporter.stats()["spool_pending"] == count  # found at start
            exporter.export([_step("w-restart", count)])  # new records queue behind the old ones
            assert until(lambda: exporter.force_flush(5_000), _PATIENCE_S), exporter.stats()
            stats = exporter.stats()
        finally:
            exporter.shutdown()
        arrived = _records_of(kafka_bootstrap, "w-restart", topic=topic)
    finally:
        admin.delete_topics([topic])
        admin.close()
    assert [r.seq for r in arrived] == list(range(count + 1))
    assert (stats["drained"], stats["spool_pending"], stats["records_failed"]) == (count + 1, 0, 0)
