"""One send path for decisions: the command line's kafka-python publisher and the stream workers' aiokafka
writer put the same key, value, signature headers and partition on the decisions topic."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from kafka.admin import KafkaAdminClient, NewTopic

from specwatch.actions.sinks.publisher import DecisionPublisher
from specwatch.schemas import Decision
from specwatch.streams.checkpoint_log import CheckpointLog
from specwatch.streams.partition_runner import Stage2Runner, StreamSettings
from specwatch.transport.config import KafkaConfig
from specwatch.transport.kafka_io import KafkaWriter, PartitionReader
from specwatch.transport.signing import Keyring

from kafka_helpers import topic_messages

_KEY = b"one-send-path-signing-key-0123456789"
# More partitions than the decisions topic needs: the two clients must place each scope alike.
_PARTITIONS = 5


def _decisions() -> list[Decision]:
    return [Decision(ts=100.0 + i, bundle_id=f"b-{i % 3}", bucket=bucket, cohort=cohort,
                     action="disable_speculation", reason="acceptance_drop", detector="acceptance_gate")
            for i, (bucket, cohort) in enumerate([("coding", "main"), ("chat", None), (None, None), ("coding", "canary"),
                                                  ("extraction", "main"), ("chat", "canary"), ("math", None)])]


def _read(bootstrap: str, topic: str) -> list[tuple]:
    return sorted(((m.partition, m.key, m.value, tuple(m.headers)) for m in topic_messages(bootstrap, topic)),
                  key=lambda m: m[2])


@pytest.mark.kafka
def test_the_publisher_and_the_stream_workers_send_the_same_messages(kafka_bootstrap):
    run = uuid.uuid4().hex[:8]
    by_publisher, by_workers = f"test.sink.kafka-python.{run}", f"test.sink.aiokafka.{run}"
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap, api_version=(4, 0))
    admin.create_topics([NewTopic(name, _PARTITIONS, 1) for name in (by_publisher, by_workers)])
    decisions = _decisions()
    try:
        with DecisionPublisher(KafkaConfig(kafka_bootstrap), topic=by_publisher,
                               keyring=Keyring.from_secrets(_KEY)) as publisher:
            assert all(publisher.publish(decision) for decision in decisions)
            assert publisher.flush(30)

        async def publish_from_a_worker() -> None:
            settings = StreamSettings(bootstrap=kafka_bootstrap, decisions_topic=by_workers,
                                      telemetry_partitions=1, partials_partitions=1)
            writer, reader = KafkaWriter(KafkaConfig(kafka_bootstrap)), PartitionReader(kafka_bootstrap)
            runner = Stage2Runner(settings, writer, reader, CheckpointLog("unused", writer, reader),
                                  assignment=lambda: (), keyring=Keyring.from_secrets(_KEY))
            try:
                await runner.publish_decisions(decisions)
            finally:
                await writer.stop()

        asyncio.run(publish_from_a_worker())
        sent_by_publisher = _read(kafka_bootstrap, by_publisher)
        sent_by_workers = _read(kafka_bootstrap, by_workers)
    finally:
        admin.delete_topics([by_publisher, by_workers])
        admin.close()
    assert len(sent_by_publisher) == len(decisions)
    assert sent_by_workers == sent_by_publisher
    assert {headers[0][0] for _, _, _, headers in sent_by_publisher} == {"specwatch-signature"}
    assert len({partition for partition, *_ in sent_by_publisher}) > 1  # scopes were spread, alike
