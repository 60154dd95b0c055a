"""A Kafka outage seen from the stream processors, on a broker this test stops and resumes."""

from __future__ import annotations

import time

import pytest
from aiokafka.errors import KafkaError

from specwatch.lab.bench.broker import OwnBroker, forget_broker_data, port_from_env

from kafka_helpers import DRAIN_TIMEOUT_S, Pipeline, assert_same_decisions, make_feed

pytestmark = pytest.mark.kafka

_PORT, _PORT_OF_THIS_RUN = port_from_env("SPECWATCH_PROCESSOR_OUTAGE_KAFKA_PORT")
_broker = OwnBroker(_PORT, partitions=4)
_OUTAGE_S = 20.0  # long enough for every client to notice; shorter than the worker's 60 s ack limit


@pytest.fixture
def own_broker():
    with _broker.running() as address:
        yield address
    if _PORT_OF_THIS_RUN:
        forget_broker_data(_PORT)


def _progress(pipeline: Pipeline) -> float:
    try:
        return pipeline.progress()
    except KafkaError:  # the group has no coordinator until it first joined
        return 0.0


def test_worker_survives_a_broker_outage_and_decides_each_decision_once(own_broker, tmp_path):
    # a fleet large enough that the worker is still reading when the broker goes: it reads
    # the 3-worker feed of the other tests within one commit interval
    feed = make_feed(own_broker, "acceptance_drop", workers=12)
    pipeline = Pipeline(own_broker, feed, tmp_path, archive=True)
    try:
        worker = pipeline.start(checkpoint_seconds=2.0)
        pipeline.wait_until(worker, lambda: _progress(pipeline) >= 0.3)
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        assert pipeline.progress() < 1.0, "the outage came too late to test anything"

        _broker("stop")
        time.sleep(_OUTAGE_S)
        assert "resuming" not in pipeline.logs()
        _broker("resume")

        restarts = 0
        while True:  # a supervisor: restart the worker whenever it stopped, until it is done
            if worker.poll() is not None:
                restarts += 1
                assert restarts <= 3, f"the worker keeps stopping: {pipeline.logs()}"
                worker = pipeline.start(checkpoint_seconds=2.0)
            try:
                pipeline.wait_drained(timeout=30.0)
                break
            except (AssertionError, KafkaError):  # not drained yet, or the group still settling
                assert time.monotonic() < deadline, pipeline.logs()
        published = assert_same_decisions(pipeline, feed)
        pipeline.assert_archived(published)
    finally:
        pipeline.stop()
    first = (tmp_path / "worker-0-0.log").read_text().splitlines()
    why = [line for line in first if "ERROR" in line or "Stalled" in line][-3:]
    print(f"\n[processor outage] {_OUTAGE_S:.0f} s outage at 30% of the telemetry; worker restarts: {restarts}; "
          f"{len(published)} decisions, each once; the first worker's last errors: {why}")
