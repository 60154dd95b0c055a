"""Stage 2 on the real broker, crashed around a publish: between deciding and publishing, and
between publishing and the next checkpoint; after the restart each decision is on the decisions
topic exactly once, with publishing first (the default) and with the checkpoint before it."""

from __future__ import annotations

import asyncio
import logging
import re
import uuid
from dataclasses import replace

import pytest
from aiokafka.admin import NewTopic

from specwatch.streams.checkpoint_log import CheckpointLog
from specwatch.streams.partition_runner import Stage1Runner, Stage2Runner, StreamSettings
from specwatch.transport.codec import decode_decision, is_heartbeat_key
from specwatch.transport.kafka_io import KafkaWriter, PartitionReader
from specwatch.transport.signing import Keyring

from kafka_helpers import create_topics, delete_topics
from telemetry_log import decision_key
from test_runner import _SETTINGS, PARTITIONS, Rig, scenario  # noqa: F401 - the fixture: the seeded telemetry

pytestmark = pytest.mark.kafka


class _Crash(Exception):
    """The worker dies here."""


class _CrashingWriter:
    """The real writer, dying at the first send ``crash_at(topic, decisions_sent)`` says yes to;
    it notes the ids of the decisions sent since the last checkpoint began."""

    def __init__(self, writer: KafkaWriter, settings: StreamSettings, crash_at) -> None:
        self._writer = writer
        self._settings = settings
        self._crash_at = crash_at
        self.decisions = 0
        self.since_checkpoint: list[str] = []

    async def send(self, topic: str, value: bytes, *, key: bytes | None = None, **options):
        decision = topic == self._settings.decisions_topic and not is_heartbeat_key(key)
        if self._crash_at(topic, self.decisions, decision):
            raise _Crash(topic)
        future = await self._writer.send(topic, value, key=key, **options)
        if decision:
            self.decisions += 1
            self.since_checkpoint.append(decode_decision(value).id)
        elif topic == self._settings.checkpoint_topic("stage2"):
            self.since_checkpoint = []
        return future

    async def stop(self) -> None:
        await self._writer.stop()


@pytest.fixture(scope="module")
def partials(scenario):
    """What stage 1 sends for the scenario (made on the in-memory twin), per partials partition,
    and the decisions stage 2 makes of it on the twin when nothing goes wrong."""
    rig = Rig(scenario[0])
    stage1 = rig.runner(Stage1Runner)
    rig.deliver_all(stage1)
    decisions = rig.decide(stage1)
    assert decisions
    return {p: [(r.key, r.value, list(r.headers)) for r in rig.kafka.records("p", p)]
            for p in range(PARTITIONS)}, decisions


async def _published(reader: PartitionReader, settings: StreamSettings) -> list:
    end = (await reader.end_offsets(settings.decisions_topic)).get(0, 0)
    return [decode_decision(m.value) for m in await reader.read(settings.decisions_topic, 0, 0, end)
            if not is_heartbeat_key(m.key)]


async def _crash_and_restart(bootstrap: str, settings: StreamSettings, partials: dict, crash_at):
    """Stage 2 folds every partials partition, a message a second, checkpointing after each, until
    ``crash_at`` kills it; a new one takes every partition over and catches up. Returns the
    decisions before the restart, the crashed writer, and the decisions after."""
    clock = [0.0]
    assigned = {(settings.partials_topic, p) for p in range(PARTITIONS)}

    def stage2(writer):
        reader = PartitionReader(bootstrap)
        return Stage2Runner(settings, writer, reader,
                            CheckpointLog(settings.checkpoint_topic("stage2"), writer, reader, Keyring()),
                            assignment=lambda: assigned, clock=lambda: clock[0], keyring=Keyring()), reader

    setup = KafkaWriter(settings.kafka_config)
    for p, messages in sorted(partials.items()):
        for key, value, headers in messages:
            await setup.send(settings.partials_topic, value, key=key, partition=p, headers=headers)
    await setup.stop()

    crashing = _CrashingWriter(KafkaWriter(settings.kafka_config), settings, crash_at)
    first, reader = stage2(crashing)
    with pytest.raises(_Crash):
        for p in range(PARTITIONS):
            end = (await reader.end_offsets(settings.partials_topic))[p]
            for message in await reader.read(settings.partials_topic, p, 0, end):
                clock[0] += 1.0
                await first.handle([message])
    await crashing.stop()  # what it had sent is acknowledged; nothing of the crashed step is buffered
    before = await _published(reader, settings)

    writer = KafkaWriter(settings.kafka_config)
    restarted, reader = stage2(writer)
    await restarted.catch_up()  # assigned now; overdue 3 s later
    clock[0] += 3.0
    await restarted.catch_up()
    await writer.stop()
    return before, crashing, await _published(reader, settings)


@pytest.fixture(params=[False, True], ids=["publish first", "checkpoint before publish"])
def settings(request, kafka_bootstrap):
    run = f"publish-crash-{uuid.uuid4().hex[:8]}"
    settings = replace(_SETTINGS, bootstrap=kafka_bootstrap, partials_topic=f"{run}.partials",
                       decisions_topic=f"{run}.decisions", deadletter_topic=f"{run}.deadletter", app_id=run,
                       checkpoint_seconds=1.0, checkpoint_before_publish=request.param)
    asyncio.run(create_topics(kafka_bootstrap, NewTopic(settings.partials_topic, PARTITIONS, 1),
                              NewTopic(settings.decisions_topic, 1, 1, topic_configs={"cleanup.policy": "compact"}),
                              NewTopic(settings.checkpoint_topic("stage2"), PARTITIONS, 1,
                                       topic_configs={"cleanup.policy": "compact"})))
    yield settings
    asyncio.run(delete_topics(kafka_bootstrap, run))


def _assert_each_once(after: list, decisions: list, scenario) -> None:
    assert len({d.id for d in after}) == len(after), "a decision was published twice"
    assert sorted(d.id for d in after) == sorted(d.id for d in decisions)  # none lost
    _, cutoff, expected = scenario
    assert sorted(decision_key(d) for d in after if d.ts < cutoff) == expected  # reason and scope as embedded


def _logged(caplog, pattern: str) -> list[tuple[str, ...]]:
    return [found.groups() for record in caplog.records if (found := re.search(pattern, record.getMessage()))]


_OUTBOX = r"restarted with (\d+) decisions in its outbox, (\d+) not yet published"
_FOUND = r": (\d+) decisions it made before its restart are on the decisions topic already"


def test_a_crash_between_deciding_and_publishing_publishes_the_decision_once_after_the_restart(
        kafka_bootstrap, settings, partials, scenario, caplog):
    messages, decisions = partials
    assert len(decisions) > 1
    caplog.set_level(logging.INFO, logger="specwatch.streams.partition_runner")
    before, crashing, after = asyncio.run(_crash_and_restart(
        kafka_bootstrap, settings, messages, lambda topic, sent, decision: decision and sent == 1))
    assert [d.id for d in before] == [decisions[0].id]
    assert crashing.decisions == 1  # the second decision never went out ...
    _assert_each_once(after, decisions, scenario)  # ... and is out once now
    if settings.checkpoint_before_publish:  # from the outbox its checkpoint holds
        assert [missing for _, missing in _logged(caplog, _OUTBOX)] == ["1"]
    else:  # decided again from the partials since the last checkpoint
        assert _logged(caplog, _OUTBOX) == []


def test_a_crash_after_publishing_and_before_the_checkpoint_publishes_nothing_again(
        kafka_bootstrap, settings, partials, scenario, caplog):
    messages, decisions = partials
    caplog.set_level(logging.INFO, logger="specwatch.streams.partition_runner")
    checkpoints = settings.checkpoint_topic("stage2")
    before, crashing, after = asyncio.run(_crash_and_restart(
        kafka_bootstrap, settings, messages, lambda topic, sent, decision: sent >= 1 and topic == checkpoints))
    unsaved = crashing.since_checkpoint  # out, and no checkpoint since says so
    assert unsaved and [d.id for d in before] == [d.id for d in decisions[:len(before)]]
    assert set(unsaved) <= {d.id for d in before}
    _assert_each_once(after, decisions, scenario)
    if settings.checkpoint_before_publish:  # the outbox its checkpoint holds is found out already
        assert _logged(caplog, _OUTBOX) == [(str(len(unsaved)), "0")]
    else:  # decided again from the partials since the last checkpoint, found on the topic
        assert _logged(caplog, _OUTBOX) == []
        assert sum(int(n) for n, in _logged(caplog, _FOUND)) == len(unsaved)
