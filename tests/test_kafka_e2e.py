"""The distributed path on the real broker (simulated workers, OTel, Kafka, Faust, decisions)
against the embedded pipeline on the same records, up to ``end - TAIL_SECONDS``."""

from __future__ import annotations

import json
import os
import signal

import pytest

from kafka_helpers import (RUN, TAIL_SECONDS, Feed, delete_topics, flag_view, make_feed, run_async,
                           topic_values)
from kafka_helpers import pipeline_factory  # noqa: F401 - the fixture: its own topics and `specwatch run` workers

pytestmark = pytest.mark.kafka


@pytest.fixture(scope="module")
def feed(kafka_bootstrap):
    """A scenario's telemetry on Kafka, made once per module by `specwatch simulate --bootstrap`."""
    feeds: dict[str, Feed] = {}

    def get(scenario: str) -> Feed:
        if scenario not in feeds:
            feeds[scenario] = make_feed(kafka_bootstrap, scenario)
        return feeds[scenario]

    yield get
    run_async(delete_topics(kafka_bootstrap, f"swtest-{RUN}-"))


@pytest.mark.parametrize("scenario", ["acceptance_drop", "kv_pressure", "bundle_change"])
def test_faust_decides_as_embedded(scenario, feed, pipeline_factory, kafka_bootstrap):
    """(a) OTel -> Kafka -> Faust -> decisions topic -> flag client and archive, equal to embedded."""
    from specwatch.collectors.flag_client import FlagClient
    from specwatch.transport.config import KafkaConfig

    data = feed(scenario)
    pipeline = pipeline_factory(data, archive=True)
    published = pipeline.decide()

    with FlagClient(KafkaConfig(kafka_bootstrap), topic=pipeline.decisions) as client:
        assert client.wait_until_caught_up(60)
        assert flag_view(client.store) == data.expected_flags
    beats = pipeline.heartbeats()
    assert beats and all(b["publisher"].startswith(f"{pipeline.app_id}/stage2-") for b in beats)
    # the watermark is event time decided up to: never past the telemetry
    assert all(b["watermark"] is None or b["watermark"] <= data.cutoff + TAIL_SECONDS for b in beats)

    dead = [json.loads(value) for _, value in topic_values(pipeline.bootstrap, pipeline.deadletter)]
    assert sorted(d["reason"] for d in dead) == ["accepted_exceeds_drafted", "invalid_otlp"]
    assert all(d["topic"] == data.topic for d in dead)
    pipeline.assert_archived(published)


def test_two_workers_decide_as_one(feed, pipeline_factory):
    """(b) `specwatch run --workers 2`: two Faust worker processes share the partitions."""
    pipeline_factory(feed("acceptance_drop")).decide(workers=2)


def test_killed_worker_loses_nothing_and_repeats_nothing(feed, pipeline_factory):
    """(c) SIGKILL mid-stream, twice, start again: the same decisions, each once on the topic and in the archive.

    The first kill lands while stage 1 is half way through the telemetry, the second right
    after the first decision went out, when the next ones may be half way through the outbox.
    """
    pipeline = pipeline_factory(feed("acceptance_drop"), archive=True)
    # Checkpoints less often than Faust commits: the restart has messages to skip and a gap to re-read.
    for killed_when in (lambda: pipeline.progress() >= 0.4, lambda: bool(pipeline.published())):
        worker = pipeline.start(checkpoint_seconds=5.0)
        pipeline.wait_until(worker, killed_when)
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
    published = pipeline.decide(checkpoint_seconds=5.0)
    assert "resumes from its checkpoint" in pipeline.logs()
    pipeline.assert_archived(published)
