"""Monitor silence on the real broker: without heartbeats a flag client falls back to its safe
state, says so once, and comes back when they resume (wall time: tests wait for states)."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

import pytest
from kafka import KafkaProducer

from specwatch.actions.sinks.publisher import DecisionPublisher
from specwatch.collectors.flag_client import SILENT_FALLBACK, FlagClient
from specwatch.transport.codec import heartbeat_message
from specwatch.transport.signing import Keyring
from specwatch.transport.config import KafkaConfig
from specwatch.schemas import Decision

from machine import until

pytestmark = pytest.mark.kafka

_API_VERSION = (4, 0)
_RING = Keyring.from_secrets(os.urandom(32))
_SILENCE_S = 3.0  # 15 heartbeats: a busy shared machine never misses that many
_BEAT_S = 0.2
_PATIENCE_S = 60.0  # a deadline for liveness on a busy machine, not a performance bound
_LOGGER = "specwatch.collectors.flag_client"


@pytest.fixture
def topic(compacted_topic):
    return compacted_topic


_DISABLE_CODING = Decision(ts=100.0, bundle_id="b-1", bucket="coding", action="disable_speculation",
                           reason="acceptance_drop", detector="al_gate")


def _publish_disable_coding(bootstrap: str, topic: str) -> None:
    with DecisionPublisher(KafkaConfig(bootstrap), topic=topic, keyring=_RING) as publisher:
        publisher.publish(_DISABLE_CODING)
        assert publisher.flush(10)


@contextlib.contextmanager
def _heartbeats(bootstrap: str, topic: str, watermark: float | None = None):
    """A monitor's signed heartbeats every _BEAT_S from a background thread, while the block runs."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, api_version=_API_VERSION)
    stop = threading.Event()

    def beat() -> None:
        seq = 0
        while seq == 0 or not stop.wait(_BEAT_S):
            key, value, headers = heartbeat_message("stage2-a", seq, watermark, keyring=_RING)
            producer.send(topic, key=key, value=value, headers=headers)
            seq += 1

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        producer.close()


def _silence_logs(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == _LOGGER and ("monitor is silent" in r.getMessage() or "resumed" in r.getMessage())]


def test_standard_decoding_fail_safe_turns_speculation_off_while_silent_and_back_after(kafka_bootstrap, topic,
                                                                                      caplog):
    config = KafkaConfig(kafka_bootstrap)
    caplog.set_level(logging.INFO, logger=_LOGGER)
    client = FlagClient(config, topic=topic, keyring=_RING, silence_seconds=_SILENCE_S,
                        fail_safe="standard_decoding").start()
    try:
        with DecisionPublisher(config, topic=topic, keyring=_RING) as publisher:
            publisher.publish(_DISABLE_CODING)
            with _heartbeats(kafka_bootstrap, topic, watermark=1234.5):
                assert until(lambda: client.stats().heartbeats >= 3 and not client.silent, _PATIENCE_S)
                assert client.lookup("b-1", "chat", "main").enabled  # heard from: decisions answer
                assert not client.lookup("b-1", "coding", "main").enabled
                assert client.stats().watermark == 1234.5

        # the monitor went away: no more heartbeats
        assert until(lambda: client.silent, _PATIENCE_S)
        assert client.lookup("b-1", "chat", "main") == SILENT_FALLBACK  # off everywhere
        assert client.lookup("other-bundle", "coding", "x") == SILENT_FALLBACK
        for _ in range(100):  # asked again and again while silent: still one transition
            client.lookup("b-1", "chat", "main")
            client.stats()
        assert client.stats().silences == 1 and client.stats().silent

        with _heartbeats(kafka_bootstrap, topic):
            assert until(lambda: not client.silent, _PATIENCE_S)
            assert client.lookup("b-1", "chat", "main").enabled
            assert not client.lookup("b-1", "coding", "main").enabled  # the last decisions hold again
    finally:
        client.stop()
    assert client.stats().silences == 1
    logs = _silence_logs(caplog)
    assert len(logs) == 2 and "OFF everywhere" in logs[0] and "resumed" in logs[1]


def test_keep_last_fail_safe_keeps_answering_from_the_last_flags(kafka_bootstrap, topic, caplog):
    caplog.set_level(logging.INFO, logger=_LOGGER)
    _publish_disable_coding(kafka_bootstrap, topic)
    with FlagClient(KafkaConfig(kafka_bootstrap), topic=topic, keyring=_RING,
                    silence_seconds=_SILENCE_S) as client:
        assert client.fail_safe == "keep_last"
        assert client.wait_until_caught_up(30)
        assert until(lambda: client.silent, _PATIENCE_S)  # a decision from before the client started is no sign of life
        assert not client.lookup("b-1", "coding", "main").enabled
        assert client.lookup("b-1", "chat", "main").enabled
        assert client.stats().silences == 1
    logs = _silence_logs(caplog)
    assert len(logs) == 1 and "keeping the last known flags" in logs[0]


def test_stale_and_replayed_heartbeats_are_no_sign_of_life(kafka_bootstrap, topic):
    """A heartbeat from an hour ago (history, or a replay) must not hold off the fail-safe."""
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, api_version=_API_VERSION)
    try:
        key, value, headers = heartbeat_message("stage2-a", 7, 50.0, keyring=_RING, wall_time=time.time() - 3600)
        producer.send(topic, key=key, value=value, headers=headers).get(timeout=10)
        fresh = heartbeat_message("stage2-b", 0, 60.0, keyring=_RING)
        producer.send(topic, key=fresh[0], value=fresh[1], headers=fresh[2]).get(timeout=10)
        with FlagClient(KafkaConfig(kafka_bootstrap), topic=topic, keyring=_RING, silence_seconds=_SILENCE_S,
                        fail_safe="standard_decoding") as client:
            assert client.wait_until_caught_up(30)
            stats = client.stats()
            assert (stats.heartbeats, stats.stale_heartbeats) == (2, 1)
            # The same signed bytes again, as an attacker replaying them would send them.
            for _ in range(3):
                producer.send(topic, key=fresh[0], value=fresh[1], headers=fresh[2]).get(timeout=10)
            assert until(lambda: client.stats().replayed == 3, _PATIENCE_S)
            assert until(lambda: client.silent, _PATIENCE_S)
            assert client.stats().heartbeats == 2
            assert client.lookup("b-1", "coding", "main") == SILENT_FALLBACK
    finally:
        producer.close()


def test_fail_safe_settings_are_checked():
    config = KafkaConfig("127.0.0.1:9")
    with pytest.raises(ValueError, match="keep_last, standard_decoding"):
        FlagClient(config, keyring=_RING, fail_safe="off")
    with pytest.raises(ValueError, match="silence_seconds must be positive"):
        FlagClient(config, keyring=_RING, silence_seconds=0)
    never = FlagClient(config, keyring=_RING, silence_seconds=None, fail_safe="standard_decoding")
    assert not never.silent and never.lookup("b", "c", "d").enabled


def test_heartbeats_stay_out_of_the_decisions_command(kafka_bootstrap, topic, capsys):
    from specwatch import cli

    _publish_disable_coding(kafka_bootstrap, topic)
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, api_version=_API_VERSION)
    for seq in range(3):
        key, value, headers = heartbeat_message("stage2-a", seq, 99.0, keyring=_RING)
        producer.send(topic, key=key, value=value, headers=headers).get(timeout=10)
    producer.close()
    assert cli.main(["decisions", "--bootstrap", kafka_bootstrap, "--topic", topic]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [_DISABLE_CODING.to_json_line()]
    assert "not a decision" not in captured.err
