"""`specwatch run` on telemetry sent with no key, as the Collector's kafka exporter sends it."""

from __future__ import annotations

import asyncio
import random
import uuid

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import NewTopic

from specwatch.lab.simulation.simulator import Simulator

from kafka_helpers import PARTITIONS, SEED, TAIL_SECONDS, Feed, create_topics, delete_topics, run_async
from telemetry_log import decision_key, exporter_batches, replayed
from kafka_helpers import pipeline_factory  # noqa: F401 - the fixture: its own topics and `specwatch run` workers

pytestmark = pytest.mark.kafka

_RUN = uuid.uuid4().hex[:8]


async def _send_unkeyed(bootstrap: str, topic: str, records, seed: int) -> int:
    """Exporter batches to seeded random partitions, no key; returns how many messages were sent."""
    rng = random.Random(seed)
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, max_request_size=4 << 20)
    await producer.start()
    try:
        futures = [await producer.send(topic, chunk, key=None, partition=rng.randrange(PARTITIONS))
                   for _, _, chunk in exporter_batches(records)]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()
    return len(futures)


@pytest.fixture
def unkeyed_feed(kafka_bootstrap):
    sim = Simulator("bundle_change", seed=SEED, workers=3, minutes=2.5, incident_at=90.0)
    records = list(sim.records())
    topic = f"swtest-unkeyed-{_RUN}.telemetry"
    run_async(create_topics(kafka_bootstrap, NewTopic(topic, PARTITIONS, 1)))
    try:
        assert run_async(_send_unkeyed(kafka_bootstrap, topic, records, seed=3)) > 100
        pipeline = replayed(records)
        cutoff = sim.end_ts - TAIL_SECONDS
        decided = [d for d in pipeline.decisions if d.ts < cutoff]
        assert any(d.action == "invalidate_bundle" for d in decided)
        yield Feed("bundle_change", topic, cutoff, sorted(decision_key(d) for d in decided), {}, len(records)), \
            sorted(d.to_json_line() for d in decided)
    finally:
        run_async(delete_topics(kafka_bootstrap, f"swtest-unkeyed-{_RUN}"))


def test_unkeyed_telemetry_gives_the_embedded_decisions_byte_for_byte(unkeyed_feed, pipeline_factory):
    feed, expected_lines = unkeyed_feed
    pipeline = pipeline_factory(feed)
    published = [d for d in pipeline.decide() if d.ts < feed.cutoff]
    assert sorted(d.to_json_line() for d in published) == expected_lines, pipeline.logs()
