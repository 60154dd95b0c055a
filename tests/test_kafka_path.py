"""The distributed path on the real Apache Kafka broker: telemetry out, decisions back in.
Every test makes its own topics, so tests (and colleagues' runs) never read each other's data."""

from __future__ import annotations

import collections
import uuid

import pytest
from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient, NewTopic

from specwatch import cli
from specwatch.actions.sinks.publisher import DecisionPublisher
from specwatch.collectors.flag_client import FlagClient
from specwatch.transport.decisions import DecisionReader
from specwatch.collectors.otel import TelemetryEmitter
from specwatch.transport.telemetry_exporter import KafkaTelemetryExporter
from specwatch.transport.config import KafkaConfig
from specwatch.schemas import (BundleCard, BundleRecord, Decision, DrafterCard, RequestRecord, RoundEntry, ShadowRecord,
                               StepRecord, TargetCard)
from specwatch.schemas.otlp import decode_request

from kafka_helpers import run_async, send_raw, topic_messages
from machine import free_port, until

pytestmark = pytest.mark.kafka

_API_VERSION = (4, 0)
_CARD = BundleCard(target=TargetCard(model_id="llama-8b", revision="r1"),
                   drafter=DrafterCard(mechanism="ngram", draft_length=4))


@pytest.fixture(scope="module")
def admin(kafka_bootstrap):
    client = KafkaAdminClient(bootstrap_servers=kafka_bootstrap, api_version=_API_VERSION)
    yield client
    client.close()


@pytest.fixture
def new_topic(admin):
    created = []

    def make(partitions: int = 4, compact: bool = False) -> str:
        name = f"test.{uuid.uuid4().hex[:12]}"
        configs = {"cleanup.policy": "compact"} if compact else {}
        admin.create_topics([NewTopic(name, partitions, 1, topic_configs=configs)])
        created.append(name)
        return name

    yield make
    admin.delete_topics(created)


def _fleet_records(workers: int = 6, steps: int = 40) -> list:
    records = [BundleRecord(v=1, ts=1.0, worker=f"w{w}", bundle_id="b-1", card=_CARD) for w in range(workers)]
    for seq in range(steps):
        for w in range(workers):  # interleaved across workers, as a fleet's exporter sees them
            records.append(StepRecord(
                v=1, ts=10.0 + seq * 0.05 + w * 1e-4, worker=f"w{w}", seq=seq, bundle_id="b-1", draft_ms=0.7,
                verify_ms=9.0 + w, kv_usage=min(1.0, seq / steps),
                requests=[RoundEntry(id=f"w{w}-r{seq}-{i}", bucket=("coding", "chat", "extraction")[i % 3],
                                     cohort="canary" if i % 2 else "main", drafted=4, accepted=(seq + i) % 5)
                          for i in range(seq % 17)]))
        if seq % 10 == 9:
            records.append(RequestRecord(
                v=1, ts=10.0 + seq * 0.05, worker=f"w{seq % workers}", bundle_id="b-1", id=f"req-{seq}",
                bucket="coding", cohort="main", speculative=True, ttft_ms=80.0, tpot_ms=None, e2e_ms=80.0,
                output_tokens=1, finish_reason="stop"))
            records.append(ShadowRecord(v=1, ts=10.0 + seq * 0.05, bundle_id="b-1", id=f"req-{seq}",
                                        bucket="coding", check="token_exact", match=seq % 20 != 19))
    return records


def _owner(record) -> str:
    return getattr(record, "worker", None) or record.bundle_id


@pytest.mark.parametrize(("sdk", "compression"), [(False, "lz4"), (True, "zstd"), (False, "gzip"), (False, "none")])
def test_emitted_records_come_back_exactly_in_per_worker_order(kafka_bootstrap, new_topic, sdk, compression):
    topic = new_topic(partitions=4)
    records = _fleet_records()
    exporter = KafkaTelemetryExporter(KafkaConfig(kafka_bootstrap, topic=topic, compression_type=compression))
    # Small batches: many messages per worker, so ordering across messages is exercised.
    with TelemetryEmitter(exporter, sdk=sdk, max_batch_size=16, schedule_delay_millis=20) as emitter:
        for record in records:
            assert emitter.emit(record)
        assert emitter.force_flush(30_000)
        assert emitter.stats().dropped == emitter.stats().failed == 0
    sent = exporter.stats()
    assert sent["records"] == len(records) and sent["records_failed"] == 0

    messages = topic_messages(kafka_bootstrap, topic)
    assert len(messages) == sent["messages"]
    by_owner = collections.defaultdict(list)
    partitions_of = collections.defaultdict(set)
    for message in sorted(messages, key=lambda m: (m.partition, m.offset)):
        decoded = decode_request(message.value)
        for record in decoded:
            assert not hasattr(record, "reason"), record
            assert message.key.decode() == _owner(record)  # key = worker, or bundle for shadows
            by_owner[_owner(record)].append(record)
        partitions_of[message.key].add(message.partition)

    expected = collections.defaultdict(list)
    for record in records:
        expected[_owner(record)].append(record)
    assert dict(by_owner) == dict(expected)  # exactly the same records, each owner in emit order
    assert all(len(p) == 1 for p in partitions_of.values())  # one owner, one partition
    assert len({p for ps in partitions_of.values() for p in ps}) > 1  # and the fleet spreads out


def _decisions() -> list[Decision]:
    return [
        Decision(ts=100.0, bundle_id="b-1", bucket="coding", cohort=None, action="disable_speculation",
                 reason="acceptance_drop", detector="al_gate", evidence={"al": 1.4, "baseline": 2.9},
                 sample_ids=["r1", "r7"]),
        Decision(ts=101.0, bundle_id="b-1", bucket="chat", cohort="canary", action="reduce_draft_length",
                 reason="draft_overhead", detector="cost", evidence={"draft_length": 2}),
        Decision(ts=102.0, bundle_id="b-2", bucket=None, cohort=None, action="invalidate_bundle",
                 reason="bundle_changed", detector="card", evidence={"changed": ["target.revision"]}),
    ]


def test_flag_client_follows_published_decisions(kafka_bootstrap, new_topic):
    topic = new_topic(partitions=1, compact=True)
    config = KafkaConfig(kafka_bootstrap)
    first, second, third = _decisions()
    with DecisionPublisher(config, topic=topic) as publisher:
        assert publisher.publish(first) and publisher.publish(second)
        assert publisher.flush(10)
        # Garbage on the topic is skipped and counted, not fatal.
        run_async(send_raw(kafka_bootstrap, topic, [(b"junk", b"\x00not json")]))

        with FlagClient(config, topic=topic) as client:
            assert client.wait_until_caught_up(20)
            assert client.lookup("b-1", "coding", "main").enabled is False
            assert client.lookup("b-1", "chat", "canary").draft_limit == 2
            assert client.lookup("b-1", "chat", "main").enabled is True
            assert client.lookup("b-2", "coding", "main").enabled is True
            stats = client.stats()
            assert (stats.applied, stats.undecodable, stats.connected) == (2, 1, True)

            # Live: a decision published now reaches the running client within moments.
            publisher.publish(third)
            publisher.publish(Decision(ts=103.0, bundle_id="b-1", bucket="coding", action="restore",
                                       reason="acceptance_drop", detector="al_gate"))
            publisher.flush(10)
            until(lambda: client.stats().applied >= 4, 10)
            assert client.lookup("b-2", "coding", "main").enabled is False
            assert client.lookup("b-1", "coding", "main").enabled is True
        assert publisher.stats() == {"published": 4, "failed": 0}


def test_flag_client_resumes_where_it_was_after_a_lost_connection(kafka_bootstrap, new_topic, monkeypatch):
    topic = new_topic(partitions=1, compact=True)
    config = KafkaConfig(kafka_bootstrap)
    disable, _, invalidate = _decisions()
    restore = Decision(ts=100.5, bundle_id="b-1", bucket="coding", action="restore", reason="acceptance_drop",
                       detector="al_gate")
    real_poll = DecisionReader.poll
    blip = {"pending": False}

    def poll(self, timeout_ms=200):
        if blip["pending"]:
            blip["pending"] = False
            raise ConnectionError("network blip")
        return real_poll(self, timeout_ms)

    monkeypatch.setattr(DecisionReader, "poll", poll)
    changes = []
    with DecisionPublisher(config, topic=topic) as publisher:
        publisher.publish(disable)
        publisher.publish(restore)
        publisher.flush(10)
        with FlagClient(config, topic=topic, retry_backoff_s=0.1, on_change=changes.append) as client:
            assert client.wait_until_caught_up(20)
            assert changes == [disable, restore]
            blip["pending"] = True
            until(lambda: client.stats().reconnects == 1 and client.stats().connected, 20)
            assert client.stats().reconnects == 1 and client.stats().connected
            publisher.publish(invalidate)
            publisher.flush(10)
            until(lambda: client.stats().applied >= 3, 20)
        # history was not replayed after the reconnect: no flag flipped back through old states
        assert changes == [disable, restore, invalidate]
        assert client.stats().applied == 3


def test_flag_client_waits_for_a_topic_that_appears_later(kafka_bootstrap, admin):
    topic = f"test.{uuid.uuid4().hex[:12]}"
    config = KafkaConfig(kafka_bootstrap)
    client = FlagClient(config, topic=topic, connect_timeout_s=2, retry_backoff_s=0.2).start()
    try:
        assert not client.wait_until_caught_up(0.5)
        admin.create_topics([NewTopic(topic, 1, 1, topic_configs={"cleanup.policy": "compact"})])
        with DecisionPublisher(config, topic=topic) as publisher:
            publisher.publish(_decisions()[0])
            publisher.flush(10)
        until(lambda: not client.lookup("b-1", "coding", "x").enabled, 20, 0.1)
        assert client.lookup("b-1", "coding", "x").enabled is False
    finally:
        client.stop()
        admin.delete_topics([topic])


def test_decisions_command_prints_the_topic_as_contract_lines(kafka_bootstrap, new_topic, capsys):
    topic = new_topic(partitions=1, compact=True)
    decisions = _decisions()
    with DecisionPublisher(KafkaConfig(kafka_bootstrap), topic=topic) as publisher:
        for decision in decisions:
            publisher.publish(decision)
        assert publisher.flush(10)
    assert cli.main(["decisions", "--bootstrap", kafka_bootstrap, "--topic", topic]) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == [d.to_json_line() for d in decisions]
    assert cli.main(["decisions", "--bootstrap", kafka_bootstrap, "--topic", new_topic(partitions=1)]) == 0
    assert capsys.readouterr().out == ""  # an empty topic prints nothing


def test_decisions_command_refuses_a_dead_broker_or_a_missing_topic(kafka_bootstrap, capsys):
    dead = f"127.0.0.1:{free_port()}"
    assert cli.main(["decisions", "--bootstrap", dead, "--timeout", "2"]) == 2
    assert "cannot reach Kafka" in capsys.readouterr().err
    assert cli.main(["decisions", "--bootstrap", kafka_bootstrap, "--topic", "no.such.topic"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_broker_script_created_the_specwatch_topics(admin):
    topics = set(admin.list_topics())
    assert {"specwatch.telemetry", "specwatch.partials", "specwatch.decisions", "specwatch.deadletter"} <= topics
    configs = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, "specwatch.decisions")])
    assert configs["topic"]["specwatch.decisions"]["cleanup.policy"]["value"] == "compact"
