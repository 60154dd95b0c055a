"""Hostile records on the checkpoint topics of a `specwatch run` worker on the real broker: at the
restart nothing runs, every one is refused and counted, the tasks rebuild from their partitions,
and what they decide again is not published twice."""

from __future__ import annotations

import os
import pickle
import re
import zlib

import pytest
from aiokafka import AIOKafkaProducer

from specwatch.schemas import Decision, Policy
from specwatch.streams.partition_runner import StreamSettings
from specwatch.streams.stage_tasks import Stage2Task, checkpoint_entries, encode_checkpoint
from specwatch.transport.signing import Keyring

from kafka_helpers import PARTITIONS, delete_topics, make_feed, run_async, topic_messages
from kafka_helpers import pipeline_factory  # noqa: F401 - the fixture: its own topics and `specwatch run` workers
from telemetry_log import decision_key

pytestmark = pytest.mark.kafka

_KEY = "checkpoint-attack-test-signing-key-0123456789"
# Above any sequence the worker wrote: each hostile checkpoint is the newest its task finds.
_SEQUENCE = 10**9


class _Shell:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _hostile_pickle(marker) -> bytes:
    """A checkpoint with the pickling versions' header whose load runs a shell command."""
    return b"SWCP1" + zlib.compress(pickle.dumps(_Shell(f"touch {marker}"), protocol=pickle.HIGHEST_PROTOCOL))


def _tampered(data: bytes) -> bytes:
    flipped = bytearray(data)
    flipped[len(flipped) // 2] ^= 0x01
    return bytes(flipped)


async def _send(bootstrap: str, topic: str, messages: list[tuple[int, bytes, bytes]]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        for partition, key, value in messages:
            await producer.send_and_wait(topic, value, key=key, partition=partition)
    finally:
        await producer.stop()


def _decided_since(bootstrap: str, topic: str, start: int) -> list[Decision]:
    return [Decision.model_validate_json(m.value) for m in topic_messages(bootstrap, topic)[start:]
            if not m.key.startswith(b"__heartbeat__/")]


@pytest.fixture
def signing(monkeypatch):
    # the worker signs decisions and checkpoints; pickled checkpoints still go through the
    # converter, as on the first start after an upgrade, so the hostile pickle reaches it
    monkeypatch.setenv("SPECWATCH_SIGNING_KEY", _KEY)
    monkeypatch.setenv("SPECWATCH_CONVERT_PICKLED_CHECKPOINTS", "1")
    monkeypatch.delenv("SPECWATCH_SIGNING_KEY_FILE", raising=False)


def test_hostile_checkpoints_run_nothing_and_the_tasks_rebuild_from_their_partitions(
        kafka_bootstrap, pipeline_factory, signing, tmp_path):
    """... and the decisions topic holds each decision once: the rebuilt stage-2 tasks decide again
    what they decided before the restart, find it on the topic and publish none of it again."""
    feed = make_feed(kafka_bootstrap, "acceptance_drop", workers=2)  # a feed topic of its own
    pipeline = pipeline_factory(feed)
    try:
        pipeline.decide(checkpoint_seconds=1.0)  # equal to the replay of the same telemetry
        pipeline.stop()
        settings = StreamSettings(kafka_bootstrap, telemetry_topics=(feed.topic,), partials_topic=pipeline.partials,
                                  app_id=pipeline.app_id)
        marker = tmp_path / "executed"
        attacker = Keyring.from_secrets(b"not-the-fleet-key-but-long-enough-000000")
        hostile: dict[str, list[tuple[int, bytes, bytes]]] = {"stage1": [], "stage2": []}
        for p in range(PARTITIONS):
            # stage 1: a pickle that would run a shell command; stage 2: a checkpoint of this format
            # signed with a key the fleet does not hold, or a genuine one with one byte changed
            task = Stage2Task(Policy(), ())
            task.next_offset = 10**6  # would skip everything the partition holds
            name = f"stage2/{pipeline.partials}/{p}"
            forged = (encode_checkpoint(task, attacker, name) if p % 2 else
                      _tampered(encode_checkpoint(task, Keyring.from_secrets(_KEY.encode()), name)))
            for stage, task_name, data in (("stage1", f"stage1/{feed.topic}/{p}", _hostile_pickle(marker)),
                                           ("stage2", name, forged)):
                # in the partition of the task's input partition, where the worker reads them
                hostile[stage] += [(p, key.encode(), value)
                                   for key, value in checkpoint_entries(task_name, _SEQUENCE, data)]
        for stage, messages in hostile.items():
            run_async(_send(kafka_bootstrap, settings.checkpoint_topic(stage), messages))
        decided_before = len(topic_messages(kafka_bootstrap, pipeline.decisions))
        before = _decided_since(kafka_bootstrap, pipeline.decisions, 0)
        assert sorted(decision_key(d) for d in before if d.ts < feed.cutoff) == feed.expected

        worker = pipeline.start(checkpoint_seconds=1.0)

        log_path = tmp_path / "worker-0-1.log"

        def refusals() -> list[str]:
            return [line for line in log_path.read_text().splitlines() if " refused (" in line]

        def not_republished() -> int:
            return sum(int(n) for n in re.findall(r": (\d+) decisions it made before its restart", log_path.read_text()))

        def redecided() -> bool:
            # every task taken over (a partition without decisions is caught up a little later), and
            # every decision made before the restart made again and found on the topic
            return len(refusals()) >= 2 * PARTITIONS and not_republished() >= len(before)

        pipeline.wait_until(worker, redecided)
        pipeline.stop()
        assert not marker.exists(), "a hostile checkpoint ran a command in the worker"
        log = log_path.read_text()
        refused = refusals()
        reasons = sorted(line.split(" refused (")[1].split(",")[0] for line in refused)
        assert reasons == ["forged", "forged", "undecodable", "undecodable", "undecodable", "undecodable",
                           "unknown_key", "unknown_key"], refused
        assert all("is not a stage-state class" in line for line in refused if "undecodable" in line)
        assert "resumes from its checkpoint" not in log  # every task rebuilt from its partition
        # decided again from the telemetry alone, the same decisions: none of them published twice
        assert not_republished() == len(before)
        assert _decided_since(kafka_bootstrap, pipeline.decisions, decided_before) == []
        every = _decided_since(kafka_bootstrap, pipeline.decisions, 0)
        assert sorted(d.id for d in every) == sorted({d.id for d in before})
    finally:
        pipeline.stop()
        for prefix in (feed.topic, pipeline.app_id):
            run_async(delete_topics(kafka_bootstrap, prefix))
