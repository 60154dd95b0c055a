"""The engine-side telemetry spool, and the Kafka exporter's switch to it and back, on an in-memory
producer that refuses on cue (the real outage: test_broker_outage.py)."""

from __future__ import annotations

import os

import pytest

from specwatch.transport.telemetry_exporter import KafkaTelemetryExporter
from specwatch.transport.config import KafkaConfig
from specwatch.transport.telemetry_spool import TelemetrySpool
from specwatch.schemas.otlp import decode_request

from machine import until
from telemetry_log import MemoryProducer, step_record


def _drain_all(spool: TelemetrySpool) -> list[bytes]:
    out = []
    while frames := spool.head(3):
        out += [f.payload for f in frames]
        spool.commit(len(frames))
    return out


def test_frames_come_back_in_order_across_segments_and_drained_segments_go(tmp_path):
    spool = TelemetrySpool(tmp_path, segment_bytes=200)
    payloads = [bytes([i]) * 50 for i in range(20)]
    for i, payload in enumerate(payloads):
        assert spool.append(b"w1", payload, records=i + 1)
    assert len(list(tmp_path.glob("*.seg"))) == 10  # two 74-byte frames per 200-byte segment
    assert _drain_all(spool) == payloads
    stats = spool.stats()
    assert (stats.spooled, stats.drained, stats.pending_records, stats.pending_bytes) == (210, 210, 0, 0)
    assert len(list(tmp_path.glob("*.seg"))) == 1  # only the one still open for appends
    spool.close()


def test_the_size_limit_refuses_and_counts_records(tmp_path):
    spool = TelemetrySpool(tmp_path, max_bytes=1_000)
    kept = [spool.append(b"w1", bytes(100), records=7) for _ in range(10)]
    assert kept == [True] * 8 + [False] * 2  # 124-byte frames: eight fit in 1,000 bytes
    stats = spool.stats()
    assert (stats.spooled, stats.dropped_full, stats.pending_records) == (56, 14, 56)
    spool.commit(1)  # room again
    assert spool.append(b"w1", bytes(100), records=7)
    spool.close()


def test_the_age_limit_drops_old_frames_when_their_turn_comes(tmp_path):
    now = [1_000.0]
    spool = TelemetrySpool(tmp_path, max_age_seconds=60, clock=lambda: now[0])
    for i in range(3):
        spool.append(b"w1", b"old%d" % i, records=5)
    now[0] += 30
    spool.append(b"w1", b"new", records=2)
    now[0] += 40  # the first three are 70 s old, the last 40 s
    assert [f.payload for f in spool.head(10)] == [b"new"]
    stats = spool.stats()
    assert (stats.dropped_expired, stats.pending_records) == (15, 2)
    spool.close()


def test_a_restart_finds_what_is_pending_and_cuts_a_torn_frame(tmp_path):
    spool = TelemetrySpool(tmp_path, segment_bytes=10_000)
    for i in range(5):
        spool.append(b"w%d" % i, b"payload-%d" % i, records=1)
    spool.commit(2)
    spool.close()
    (segment,) = tmp_path.glob("*.seg")
    with open(segment, "ab") as f:
        f.write(b"\x40\x00\x00\x00torn")  # a crash in the middle of a frame

    again = TelemetrySpool(tmp_path)
    stats = again.stats()
    assert (stats.pending_records, stats.corrupt_frames) == (3, 1)
    assert [(f.key, f.payload) for f in again.head(10)] == [(b"w2", b"payload-2"), (b"w3", b"payload-3"),
                                                           (b"w4", b"payload-4")]
    again.append(b"w5", b"payload-5", records=1)  # appends go to a new segment after the cut one
    assert _drain_all(again)[-1] == b"payload-5"
    again.close()


def test_one_process_per_spool_directory(tmp_path):
    spool = TelemetrySpool(tmp_path)
    with pytest.raises(ValueError, match="in use by another process"):
        TelemetrySpool(tmp_path)
    spool.close()
    TelemetrySpool(tmp_path).close()  # free again once closed


def test_spool_settings_from_the_environment(tmp_path):
    assert TelemetrySpool.from_env({"SPECWATCH_TELEMETRY_SPOOL_DIR": "none"}, name="x") is None
    with pytest.raises(ValueError, match="SPECWATCH_TELEMETRY_SPOOL_MAX_BYTES must be a number, got '1G'"):
        TelemetrySpool.from_env({"SPECWATCH_TELEMETRY_SPOOL_MAX_BYTES": "1G", "XDG_CACHE_HOME": str(tmp_path)},
                                name="x")
    env = {"XDG_CACHE_HOME": str(tmp_path), "SPECWATCH_TELEMETRY_SPOOL_MAX_AGE_SECONDS": "90"}
    first = TelemetrySpool.from_env(env, name="vllm-gpu0")
    second = TelemetrySpool.from_env(env, name="vllm-gpu0")  # a second engine with the same name
    assert first.directory == tmp_path / "specwatch" / "telemetry-spool" / "vllm-gpu0"
    assert second.directory.name == f"vllm-gpu0-{os.getpid()}" and second.max_age_seconds == 90
    first.close()
    second.close()
    named = {"SPECWATCH_TELEMETRY_SPOOL_DIR": str(tmp_path / "mine")}
    held = TelemetrySpool.from_env(named, name="x")
    with pytest.raises(ValueError, match="in use"):
        TelemetrySpool.from_env(named, name="x")  # a directory named on purpose is never replaced
    held.close()


def _steps(start: int, count: int) -> list:
    return [step_record("w1", seq, requests=1) for seq in range(start, start + count)]


def _exporter(producer: MemoryProducer, spool_dir=None, **config) -> KafkaTelemetryExporter:
    spool = TelemetrySpool(spool_dir) if spool_dir else None
    return KafkaTelemetryExporter(KafkaConfig("127.0.0.1:9", **config), producer=producer,
                                  spool=spool, drain_backoff_s=(0.01, 0.05))


def _delivered_seqs(producer: MemoryProducer) -> list[int]:
    return [r.seq for value in producer.delivered for r in decode_request(value)]


def test_failed_sends_and_deliveries_spool_in_order_and_drain_when_kafka_is_back(tmp_path):
    producer = MemoryProducer()
    exporter = _exporter(producer, tmp_path, delivery_timeout_ms=1_000)
    exporter.export(_steps(0, 3))
    producer.flush()
    producer.fail_deliveries = True  # the broker goes: what is in flight fails on delivery...
    exporter.export(_steps(3, 2))
    producer.up = False  # ...and then sends fail too
    exporter.export(_steps(5, 2))
    assert exporter.export(_steps(7, 2)).name == "SUCCESS"  # on disk: nothing lost
    stats = exporter.stats()
    assert (stats["spool_pending"], stats["records_failed"], stats["delivery_errors"]) == (6, 0, 1)
    assert _delivered_seqs(producer) == [0, 1, 2]

    producer.fail_deliveries, producer.up = False, True
    assert until(lambda: exporter.stats()["spool_pending"] == 0 and not exporter._spooling)
    exporter.export(_steps(9, 1))  # direct again
    producer.flush()
    assert _delivered_seqs(producer) == list(range(10))
    assert exporter.stats()["drained"] == 6
    exporter.shutdown()


@pytest.mark.parametrize("fails", ["send", "delivery"])
def test_without_a_spool_failed_records_are_counted_lost(fails):
    producer = MemoryProducer()
    producer.up, producer.fail_deliveries = fails != "send", fails == "delivery"
    exporter = _exporter(producer)
    assert exporter.export(_steps(0, 4)).name == ("FAILURE" if fails == "send" else "SUCCESS")
    producer.flush()  # a delivery fails later, on the producer's thread
    assert exporter.stats()["records_failed"] == 4
    exporter.shutdown()


def test_a_disk_that_refuses_drops_and_counts(tmp_path):
    spool = TelemetrySpool(tmp_path, segment_bytes=100)
    assert spool.append(b"w1", bytes(50), records=3)
    (tmp_path / f"{1:016d}.seg").mkdir()  # the next segment cannot be opened as a file, even by root
    assert not spool.append(b"w1", bytes(80), records=4)  # needs the next segment: refused, counted
    stats = spool.stats()
    assert (stats.dropped_unwritable, stats.pending_records, stats.spooled) == (4, 3, 3)
    assert [f.records for f in spool.head(5)] == [3]
    spool.close()
    again = TelemetrySpool(tmp_path)
    assert again.stats().pending_records == 3  # and it still opens
    again.close()
