"""The Faust app: the processing topology on Kafka, the same stages the embedded pipeline runs.

Agent ``combine`` folds each telemetry partition in a `Stage1Task` and sends slice batches
to the partials topic, routed by bundle; agent ``decide`` merges them per partials
partition in a `Stage2Task` and publishes decisions to the compacted decisions topic.

State and guarantees
--------------------
Every task is checkpointed to a compacted checkpoint topic (a changelog: chunked, two
alternating slots, written by the app's own idempotent producer and awaited until the
broker acknowledged it) together with the offset of the next message it has to fold;
the checkpoint, not Faust's committed offset, is where a task resumes. A restarted or moved task skips what
it folded before and reads directly from Kafka what its checkpoint does not cover (also
what Faust commits past without delivering, which it does around rebalances). A task
without a checkpoint rebuilds from the start of its partition.

- Telemetry: folded once. Stage 1 checkpoints only after the broker acknowledged the
  batches it sent; replays re-send identical batches (stage 1 is deterministic), and
  stage 2 drops any batch at or below the last slice it merged from that source.
- Decisions: a function of the telemetry log alone (event time; the wall clock only paces
  checkpoints and releases silent partitions). Before publishing, stage 2 checkpoints them
  as an outbox with the decisions topic's end offsets; a restart publishes only those not
  found on the topic after those offsets. Each decision reaches the topic once, unless a
  worker keeps publishing after losing its partitions (a pause longer than the session
  timeout): then a decision can appear twice, with the same id, which `FlagStore.apply`
  and the archive absorb.
- Archive: written before each checkpoint; writes are idempotent (stable ids,
  ReplacingMergeTree), so replayed slices leave one row each. Dead letters: at least once.
- Liveness: stage 2 waits for every telemetry partition. One with nothing left to read,
  silent for ``source_silence_seconds`` and behind by more than the policy's
  ``source_idle_seconds`` is released through a marker in the partials log (so replays
  decide the same); telemetry it sends later for decided slices counts as late. Slices
  within the allowed lateness of the newest telemetry wait for more telemetry.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Iterable, Mapping

import faust
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaConnectionError, KafkaError
from faust.types import TP
from faust.types.tuples import Message as FaustMessage
from mode import CrashingSupervisor

from specwatch.actions.decisions_topic import heartbeat_message
from specwatch.actions.signing import Keyring, sign_line
from specwatch.schemas import Policy, Rejection, RejectionCounter

from .metrics import ServiceHealth
from .operations import Operations, OperationsSettings
from .faust_tasks import (
    BundleOwner,
    CheckpointError,
    Stage1Task,
    Stage2Task,
    checkpoint_entries,
    dead_letter,
    decision_message,
    decisions_in,
    decode_checkpoint,
    decode_partial,
    encode_checkpoint,
    encode_partial,
    encode_release,
    outbox_pending,
    read_checkpoint,
    route_batches,
)

__all__ = [
    "BrokerUnavailable",
    "StreamApp",
    "StreamSettings",
    "TopicError",
    "aiokafka_security",
    "create_app",
    "faust_credentials",
    "prepare_topics",
    "run_worker",
]

logger = logging.getLogger(__name__)

DEFAULT_TELEMETRY_TOPIC = "specwatch.telemetry"
DEFAULT_PARTIALS_TOPIC = "specwatch.partials"
DEFAULT_DECISIONS_TOPIC = "specwatch.decisions"
DEFAULT_DEADLETTER_TOPIC = "specwatch.deadletter"
_DEFAULT_APP_ID = "specwatch"
_DEFAULT_PARTITIONS = 4
_DEFAULT_CHECKPOINT_SECONDS = 2.0
_DEFAULT_SOURCE_SILENCE_SECONDS = 10.0
_DEFAULT_SESSION_TIMEOUT_SECONDS = 30.0
_DEFAULT_CONNECT_TIMEOUT_MS = 10_000
_RELEASE_CHECK_SECONDS = 1.0
# A partition assigned this long without delivering anything is restored and caught up by hand.
_CATCH_UP_AFTER_S = 3.0
# Flag clients count three missed heartbeats before they call the topic silent (30 s).
_HEARTBEAT_SECONDS = 10.0
# How long a send may wait for the broker's acknowledgement before the worker gives up
# and exits (to restart from its checkpoint) rather than hang.
_ACK_TIMEOUT_S = 60.0
_PROGRESS_LOG_SECONDS = 60.0
_READ_POLL_MS = 500
_READ_BATCH = 500
_LINGER_MS = 5
# Checkpoint chunks are 512 KiB; partial batches and decisions far smaller.
_MAX_REQUEST_BYTES = 2 << 20
# Checkpoint topics keep one live value per key; small segments let compaction drop
# superseded checkpoints soon, so a restart reads little.
_CHECKPOINT_TOPIC_CONFIG = {"cleanup.policy": "compact", "segment.bytes": str(16 << 20),
                            "min.cleanable.dirty.ratio": "0.1", "max.message.bytes": str(2 << 20)}
_DECISIONS_TOPIC_CONFIG = {"cleanup.policy": "compact", "min.cleanable.dirty.ratio": "0.1",
                           "segment.ms": "600000"}


class BrokerUnavailable(RuntimeError):
    """The Kafka cluster cannot be reached at the given bootstrap address."""


class TopicError(RuntimeError):
    """The topics exist in a shape the topology cannot run on."""


@dataclass(frozen=True)
class StreamSettings:
    """Everything a worker needs; validated once, before Faust starts.

    Parameters
    ----------
    bootstrap
        ``HOST:PORT[,HOST:PORT...]`` of the Kafka cluster.
    telemetry_topics
        Topics of OTLP telemetry (one `Stage1Task` per partition of each).
    partials_topic, decisions_topic, deadletter_topic
        Stage 1 -> stage 2 batches; decisions (compacted); rejected records.
    app_id
        Consumer group and prefix of the checkpoint topics.
    policy
        Windows, gates and actions.
    archive_dsn
        Where stage 2 archives decisions, samples and window stats; None = no archive.
    data_dir
        This worker's local directory (Faust's datadir).
    telemetry_partitions, partials_partitions
        Partition counts, read from the cluster by `prepare_topics`.
    checkpoint_seconds
        Wall-clock interval between checkpoints of a busy task (decisions checkpoint at once).
    source_silence_seconds
        A telemetry partition that sent nothing for this long, while behind the others by
        more than the policy's ``source_idle_seconds`` of event time and with nothing left to
        read, stops holding slices back.
    session_timeout_seconds
        Kafka consumer session timeout: how soon a dead worker's partitions move.
    replication_factor
        Of the changelog topics Faust creates.
    operations
        The web server (metrics, health, Alertmanager webhook) and where decisions go as alerts.
    """

    bootstrap: str
    telemetry_topics: tuple[str, ...] = (DEFAULT_TELEMETRY_TOPIC,)
    partials_topic: str = DEFAULT_PARTIALS_TOPIC
    decisions_topic: str = DEFAULT_DECISIONS_TOPIC
    deadletter_topic: str = DEFAULT_DEADLETTER_TOPIC
    app_id: str = _DEFAULT_APP_ID
    policy: Policy = field(default_factory=Policy)
    archive_dsn: str | None = None
    data_dir: str = "specwatch-data/faust/worker-0"
    telemetry_partitions: int = 0
    partials_partitions: int = 0
    checkpoint_seconds: float = _DEFAULT_CHECKPOINT_SECONDS
    source_silence_seconds: float = _DEFAULT_SOURCE_SILENCE_SECONDS
    session_timeout_seconds: float = _DEFAULT_SESSION_TIMEOUT_SECONDS
    replication_factor: int = 1
    kafka_security: Mapping[str, Any] = field(default_factory=dict, repr=False)
    operations: OperationsSettings = field(default_factory=OperationsSettings)

    def __post_init__(self) -> None:
        if not self.bootstrap or not all(":" in s for s in self.bootstrap.split(",")):
            raise ValueError(f"bootstrap must be HOST:PORT[,HOST:PORT...], got {self.bootstrap!r}")
        if not self.telemetry_topics:
            raise ValueError("at least one telemetry topic is needed")
        names = [*self.telemetry_topics, self.partials_topic, self.decisions_topic, self.deadletter_topic]
        if len(set(names)) != len(names):
            raise ValueError(f"telemetry, partials, decisions and dead-letter topics must differ, got {names}")
        if not self.checkpoint_seconds > 0:
            raise ValueError(f"checkpoint_seconds must be > 0, got {self.checkpoint_seconds}")
        if not self.source_silence_seconds > 0:
            raise ValueError(f"source_silence_seconds must be > 0, got {self.source_silence_seconds}")
        if not self.session_timeout_seconds >= 6:
            raise ValueError("session_timeout_seconds must be >= 6 (the broker's minimum session), "
                             f"got {self.session_timeout_seconds}")
        if self.replication_factor < 1:
            raise ValueError(f"replication_factor must be >= 1, got {self.replication_factor}")

    def client_options(self) -> dict[str, Any]:
        """Connection options every aiokafka client of the app takes (security included)."""
        return dict(self.kafka_security)

    def checkpoint_topic(self, stage: str) -> str:
        """The compacted topic holding the checkpoints of ``stage`` ("stage1" or "stage2")."""
        return f"{self.app_id}.{stage}-checkpoints"

    @property
    def sources(self) -> tuple[str, ...]:
        """Every telemetry partition, named as stage 2 knows it."""
        return tuple(f"{topic}/{p}" for topic in self.telemetry_topics for p in range(self.telemetry_partitions))


# ---------------------------------------------------------------- topics


async def prepare_topics(settings: StreamSettings, default_partitions: int = _DEFAULT_PARTITIONS) -> StreamSettings:
    """Reach the cluster, create missing topics, and return settings with partition counts.

    Raises `BrokerUnavailable` when no broker answers, `TopicError` when telemetry topics
    disagree on their partition count.
    """
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.bootstrap.split(","),
                                request_timeout_ms=_DEFAULT_CONNECT_TIMEOUT_MS, **settings.client_options())
    try:
        client_log = logging.getLogger("aiokafka")
        level = client_log.level
        client_log.setLevel(logging.CRITICAL)  # the error below says it once, with the address
        try:
            await admin.start()
        except (KafkaConnectionError, KafkaError, OSError) as error:
            raise BrokerUnavailable(f"cannot reach Kafka at {settings.bootstrap}: {error}") from error
        finally:
            client_log.setLevel(level)
        try:
            return await _ensure_topics(admin, settings, default_partitions)
        except KafkaError as error:
            raise TopicError(f"cannot inspect or create the topics on {settings.bootstrap}: {error}") from error
    finally:
        await admin.close()


async def _ensure_topics(admin: AIOKafkaAdminClient, settings: StreamSettings,
                         default_partitions: int) -> StreamSettings:
    """Create what is missing; the partition counts the topology runs on."""
    existing = await _partition_counts(admin, settings)
    telemetry = {t: existing.get(t) for t in settings.telemetry_topics}
    counts = {n for n in telemetry.values() if n}
    if len(counts) > 1:
        raise TopicError(f"telemetry topics must have the same number of partitions, got {telemetry}")
    telemetry_partitions = counts.pop() if counts else default_partitions
    wanted = [NewTopic(t, telemetry_partitions, settings.replication_factor)
              for t, n in telemetry.items() if not n]
    if not existing.get(settings.partials_topic):
        wanted.append(NewTopic(settings.partials_topic, telemetry_partitions, settings.replication_factor))
    if not existing.get(settings.deadletter_topic):
        wanted.append(NewTopic(settings.deadletter_topic, telemetry_partitions, settings.replication_factor))
    if not existing.get(settings.decisions_topic):
        wanted.append(NewTopic(settings.decisions_topic, 1, settings.replication_factor,
                               topic_configs=dict(_DECISIONS_TOPIC_CONFIG)))
    if wanted:
        logger.info("creating topics %s", ", ".join(t.name for t in wanted))
        await admin.create_topics(wanted)
        existing = await _partition_counts(admin, settings)
    partials_partitions = existing[settings.partials_topic]
    # One checkpoint partition per input partition: a task's checkpoints live beside its input.
    checkpoints = {settings.checkpoint_topic("stage1"): telemetry_partitions,
                   settings.checkpoint_topic("stage2"): partials_partitions}
    present = await _partition_counts(admin, settings, names=list(checkpoints))
    for name, partitions in checkpoints.items():
        if name in present and present[name] != partitions:
            raise TopicError(f"checkpoint topic {name} has {present[name]} partitions, the topic it "
                             f"follows has {partitions}: delete it, or use another --app-id")
    missing = [NewTopic(name, partitions, settings.replication_factor, topic_configs=dict(_CHECKPOINT_TOPIC_CONFIG))
               for name, partitions in checkpoints.items() if name not in present]
    if missing:
        await admin.create_topics(missing)
    return replace(settings, telemetry_partitions=telemetry_partitions, partials_partitions=partials_partitions)


async def _partition_counts(admin: AIOKafkaAdminClient, settings: StreamSettings,
                            names: list[str] | None = None) -> dict[str, int]:
    if names is None:
        names = [*settings.telemetry_topics, settings.partials_topic, settings.decisions_topic,
                 settings.deadletter_topic]
    present = set(await admin.list_topics())
    described = await admin.describe_topics([n for n in names if n in present]) if present else []
    return {d["topic"]: len(d["partitions"]) for d in described if not d.get("error_code")}


# ---------------------------------------------------------------- direct reads


def aiokafka_security(config: Any) -> dict[str, Any]:
    """aiokafka client options for the security settings of a `KafkaConfig`; {} for PLAINTEXT.

    >>> from specwatch.collectors.otel import KafkaConfig
    >>> aiokafka_security(KafkaConfig("k:9092"))
    {}
    >>> options = aiokafka_security(KafkaConfig("k:9093", security_protocol="SASL_PLAINTEXT",
    ...                                         sasl_mechanism="PLAIN", sasl_username="svc", sasl_password="pw"))
    >>> options["security_protocol"], options["sasl_mechanism"], options["sasl_plain_username"]
    ('SASL_PLAINTEXT', 'PLAIN', 'svc')
    """
    protocol = config.security_protocol
    if protocol == "PLAINTEXT":
        return {}
    options: dict[str, Any] = {"security_protocol": protocol}
    if protocol.startswith("SASL_"):
        options.update(sasl_mechanism=config.sasl_mechanism, sasl_plain_username=config.sasl_username,
                       sasl_plain_password=config.sasl_password)
    if protocol in ("SSL", "SASL_SSL"):
        from aiokafka.helpers import create_ssl_context

        context = create_ssl_context(cafile=config.ssl_cafile, certfile=config.ssl_certfile,
                                     keyfile=config.ssl_keyfile, password=config.ssl_password)
        context.check_hostname = config.ssl_check_hostname
        options["ssl_context"] = context
    return options


def faust_credentials(security: Mapping[str, Any]) -> Any:
    """Faust's broker credentials for the same options (None: PLAINTEXT)."""
    protocol = security.get("security_protocol", "PLAINTEXT")
    if protocol == "PLAINTEXT":
        return None
    if protocol == "SSL":
        return faust.SSLCredentials(security["ssl_context"])
    return faust.SASLCredentials(username=security["sasl_plain_username"], password=security["sasl_plain_password"],
                                 mechanism=security["sasl_mechanism"], ssl_context=security.get("ssl_context"))


class PartitionReader:
    """Reads ranges of partitions outside the consumer group: gaps after a restart, the decisions tail."""

    def __init__(self, bootstrap: str, security: Mapping[str, Any] | None = None) -> None:
        self._bootstrap = bootstrap.split(",")
        self._security = dict(security or {})
        self._partitions: dict[str, list[int]] = {}

    async def partitions(self, topic: str) -> list[int]:
        """Partition ids of ``topic`` (asked once: partitions are only ever added by hand)."""
        if topic not in self._partitions:
            admin = AIOKafkaAdminClient(bootstrap_servers=self._bootstrap,
                                        request_timeout_ms=_DEFAULT_CONNECT_TIMEOUT_MS, **self._security)
            await admin.start()
            try:
                described = await admin.describe_topics([topic])
            finally:
                await admin.close()
            found = [p["partition"] for d in described if d["topic"] == topic and not d.get("error_code")
                     for p in d["partitions"]]
            if not found:
                return []
            self._partitions[topic] = sorted(found)
        return self._partitions[topic]

    async def _consumer(self) -> AIOKafkaConsumer:
        consumer = AIOKafkaConsumer(bootstrap_servers=self._bootstrap, **self._security, group_id=None,
                                    enable_auto_commit=False,
                                    auto_offset_reset="earliest", isolation_level="read_committed")
        await consumer.start()
        return consumer

    async def iter_range(self, topic: str, partition: int, start: int, end: int) -> AsyncIterator[Any]:
        """Messages with ``start <= offset < end`` of one partition, in order (fewer if the log ends first)."""
        if end <= start:
            return
        tp = TopicPartition(topic, partition)
        consumer = await self._consumer()
        try:
            consumer.assign([tp])
            consumer.seek(tp, start)
            end = min(end, (await consumer.end_offsets([tp]))[tp])
            while await consumer.position(tp) < end:
                batch = await consumer.getmany(tp, timeout_ms=_READ_POLL_MS, max_records=_READ_BATCH)
                for message in batch.get(tp, []):
                    if message.offset >= end:
                        return
                    yield message
        finally:
            await consumer.stop()

    async def read(self, topic: str, partition: int, start: int, end: int) -> list[Any]:
        return [message async for message in self.iter_range(topic, partition, start, end)]

    async def beginning_offset(self, topic: str, partition: int) -> int:
        tp = TopicPartition(topic, partition)
        consumer = await self._consumer()
        try:
            return (await consumer.beginning_offsets([tp]))[tp]
        finally:
            await consumer.stop()

    async def end_offsets(self, topic: str) -> dict[int, int]:
        partitions = await self.partitions(topic)
        if not partitions:
            return {}
        consumer = await self._consumer()
        try:
            offsets = await consumer.end_offsets([TopicPartition(topic, p) for p in partitions])
            return {tp.partition: offset for tp, offset in offsets.items()}
        finally:
            await consumer.stop()

    async def drained(self, group: str, sources: Iterable[str]) -> set[str]:
        """The sources (``topic/partition``) with nothing left to read: all committed by ``group``, or empty."""
        tps = {source: TopicPartition(*_split_source(source)) for source in sources}
        if not tps:
            return set()
        admin = AIOKafkaAdminClient(bootstrap_servers=self._bootstrap, request_timeout_ms=_DEFAULT_CONNECT_TIMEOUT_MS,
                                    **self._security)
        await admin.start()
        try:
            committed = await admin.list_consumer_group_offsets(group, partitions=list(tps.values()))
        finally:
            await admin.close()
        consumer = await self._consumer()
        try:
            begin = await consumer.beginning_offsets(list(tps.values()))
            end = await consumer.end_offsets(list(tps.values()))
        finally:
            await consumer.stop()
        out = set()
        for source, tp in tps.items():
            mark = committed.get(tp)
            if end[tp] <= begin[tp] or (mark is not None and mark.offset >= end[tp]):
                out.add(source)
        return out

    async def values_since(self, topic: str, marks: dict[int, int]) -> list[bytes]:
        """Values written to ``topic`` after ``marks`` (partition -> offset), up to its current end."""
        ends = await self.end_offsets(topic)
        values: list[bytes] = []
        for partition, end in sorted(ends.items()):
            for message in await self.read(topic, partition, marks.get(partition, 0), end):
                values.append(message.value)
        return values


# ---------------------------------------------------------------- writes


class KafkaStalled(RuntimeError):
    """The broker did not acknowledge what this worker sent; it stops rather than hang."""


class KafkaWriter:
    """The app's own producer: every send can be awaited until the broker has it.

    Faust's producer buffers table and ``send_soon`` writes and its flush gives up after a
    moment, which is no ground for "written before published"; this one is idempotent and
    acknowledges with ``acks=all``.
    """

    def __init__(self, bootstrap: str, security: Mapping[str, Any] | None = None) -> None:
        self._bootstrap = bootstrap.split(",")
        self._security = dict(security or {})
        self._producer: AIOKafkaProducer | None = None

    async def send(self, topic: str, value: bytes, *, key: bytes | None = None, partition: int | None = None,
                   headers: list[tuple[str, bytes]] | None = None) -> asyncio.Future:
        """Hand one message to the producer; the returned future resolves when the broker acknowledged it."""
        if self._producer is None:
            producer = AIOKafkaProducer(bootstrap_servers=self._bootstrap, **self._security, acks="all",
                                        enable_idempotence=True,
                                        linger_ms=_LINGER_MS, compression_type="lz4",
                                        max_request_size=_MAX_REQUEST_BYTES)
            await producer.start()
            self._producer = producer
        return await self._producer.send(topic, value, key=key, partition=partition, headers=headers)

    async def stop(self) -> None:
        if self._producer is not None:
            producer, self._producer = self._producer, None
            await producer.stop()  # sends what is buffered first


async def acknowledged(futures: list[asyncio.Future], what: str) -> None:
    """Wait until the broker acknowledged every future's message; raise `KafkaStalled` after a while."""
    if not futures:
        return
    try:
        await asyncio.wait_for(asyncio.gather(*futures), _ACK_TIMEOUT_S)
    except asyncio.TimeoutError as error:
        raise KafkaStalled(f"Kafka did not acknowledge {len(futures)} {what} within {_ACK_TIMEOUT_S:.0f} s; "
                           "stopping this worker, which resumes from its checkpoint when restarted") from error


# ---------------------------------------------------------------- checkpoints


class CheckpointLog:
    """Task checkpoints on a compacted topic, in the partition of the task's input partition.

    A save returns once the broker acknowledged every chunk, so a checkpoint that exists
    was whole when anything after it was sent. A load reads the partition from its start
    (compaction keeps it short) and takes the newest whole checkpoint.
    """

    def __init__(self, topic: str, writer: KafkaWriter, reader: PartitionReader) -> None:
        self.topic = topic
        self._writer = writer
        self._reader = reader
        self._sequence: dict[str, int] = {}

    async def load(self, name: str, partition: int) -> Stage1Task | Stage2Task | None:
        prefix = f"{name}#".encode()
        latest: dict[str, bytes] = {}
        begin = await self._reader.beginning_offset(self.topic, partition)
        end = (await self._reader.end_offsets(self.topic)).get(partition, begin)
        async for message in self._reader.iter_range(self.topic, partition, begin, end):
            if message.key and message.key.startswith(prefix) and message.value is not None:
                latest[message.key.decode()] = message.value
        found = read_checkpoint(name, latest.get)
        if found is None:
            return None
        sequence, data = found
        self._sequence[name] = sequence
        try:
            return decode_checkpoint(data)
        except CheckpointError as error:
            logger.error("checkpoint %s is unusable (%s); the task rebuilds from its partition", name, error)
            return None

    async def save(self, name: str, partition: int, task: Stage1Task | Stage2Task) -> int:
        """Write a checkpoint and wait until the broker has all of it; returns its size in bytes."""
        sequence = self._sequence.get(name, 0) + 1
        data = encode_checkpoint(task)
        sent = [await self._writer.send(self.topic, value, key=key.encode(), partition=partition)
                for key, value in checkpoint_entries(name, sequence, data)]
        await acknowledged(sent, "checkpoint chunks")
        self._sequence[name] = sequence
        return len(data)


# ---------------------------------------------------------------- stage 1


class Stage1Runner:
    """The I/O around stage 1: decode and fold, send batches and dead letters, checkpoint, replay gaps."""

    def __init__(self, settings: StreamSettings, app: faust.App, writer: KafkaWriter,
                 checkpoints: CheckpointLog, reader: PartitionReader) -> None:
        self.settings = settings
        self._app = app
        self._writer = writer
        self._checkpoints = checkpoints
        self._reader = reader
        self._tasks: dict[tuple[str, int], Stage1Task] = {}
        self._lock = asyncio.Lock()  # the agent and the catch-up timer never work on a task at once
        self._assigned_at: dict[tuple[str, int], float] = {}
        self._pending: dict[tuple[str, int], list[asyncio.Future]] = {}
        self._checkpointed_at: dict[tuple[str, int], float] = {}
        self.records = 0
        self.rejected = RejectionCounter()
        self.engines_seen: dict[str, float] = {}  # engine worker -> wall time of its newest record
        self.batches_sent = 0
        self.skipped = 0

    async def handle(self, event: Any) -> None:
        message = event.message
        tp = (message.topic, message.partition)
        async with self._lock:
            task = self._tasks.get(tp)
            if task is None:
                task = self._tasks[tp] = await self._restore(tp)
            if message.offset < task.next_offset:
                self.skipped += 1  # folded before the restart
                return
            if message.offset > task.next_offset:
                await self._replay(task, tp, message.offset)
            await self._fold(task, tp, message.offset, message.key, message.value)
            if time.monotonic() - self._checkpointed_at.get(tp, 0.0) >= self.settings.checkpoint_seconds:
                await self._checkpoint(task, tp)

    async def catch_up(self) -> None:
        """Owned telemetry partitions that delivered nothing since they were assigned: restore
        their tasks and fold what the checkpoints do not cover. Faust delivers only what is
        past the group's commit, and a worker killed after committing but before its next
        checkpoint leaves that gap unread until new telemetry arrives, which it may never."""
        assigned = {(tp.topic, tp.partition) for tp in self._app.consumer.assignment()
                    if tp.topic in self.settings.telemetry_topics}
        waiting = _overdue(assigned, self._tasks, self._assigned_at)
        if not waiting:
            return
        ends: dict[str, dict[int, int]] = {}
        for tp in waiting:
            async with self._lock:
                if tp in self._tasks:
                    continue  # a message arrived meanwhile
                task = self._tasks[tp] = await self._restore(tp)
                if tp[0] not in ends:
                    ends[tp[0]] = await self._reader.end_offsets(tp[0])
                end = ends[tp[0]].get(tp[1], 0)
                if end > task.next_offset:
                    await self._replay(task, tp, end)
                    await self._checkpoint(task, tp)

    def forget(self, tps: Iterable[Any]) -> None:
        """Partitions taken away: their next owner resumes from the checkpoint."""
        for tp in tps:
            key = (tp.topic, tp.partition)
            self._tasks.pop(key, None)
            self._pending.pop(key, None)

    async def _restore(self, tp: tuple[str, int]) -> Stage1Task:
        name = _task_name("stage1", *tp)
        task = await self._checkpoints.load(name, tp[1])
        if isinstance(task, Stage1Task):
            logger.info("%s resumes from its checkpoint at offset %d (records so far %d)",
                        name, task.next_offset, task.records)
            self._checkpointed_at[tp] = time.monotonic()
            return task
        # No checkpoint: the state is whatever the partition holds, from its first message,
        # wherever the group's committed offset points.
        task = Stage1Task(self.settings.policy, f"{tp[0]}/{tp[1]}")
        task.next_offset = await self._reader.beginning_offset(*tp)
        return task

    async def _replay(self, task: Stage1Task, tp: tuple[str, int], upto: int) -> None:
        start = task.next_offset
        logger.info("%s reads offsets %d..%d that its checkpoint does not cover", _task_name("stage1", *tp),
                    start, upto - 1)
        async for message in self._reader.iter_range(tp[0], tp[1], start, upto):
            if message.offset > task.next_offset:
                logger.warning("%s: offsets %d..%d are gone from the log (retention); their telemetry is lost",
                               _task_name("stage1", *tp), task.next_offset, message.offset - 1)
            await self._fold(task, tp, message.offset, message.key, message.value)
            _acknowledge(self._app, message)
        task.next_offset = upto

    async def _fold(self, task: Stage1Task, tp: tuple[str, int], offset: int, key: bytes | None,
                    value: bytes) -> None:
        before = task.records
        rejections, closed = task.fold(offset, value or b"", now=time.time(), seen=self.engines_seen)
        self.records += task.records - before
        pending = self._pending.setdefault(tp, [])
        for rejection in rejections:
            self.rejected.add(rejection)
            pending.append(await self._writer.send(self.settings.deadletter_topic,
                                                   dead_letter(rejection, tp[0], tp[1], offset), key=key))
        for partition, batch in route_batches(closed, self.settings.partials_partitions):
            pending.append(await self._writer.send(self.settings.partials_topic, encode_partial(batch),
                                                   key=batch.source.encode(), partition=partition))
            self.batches_sent += 1

    def health(self, now: float, consumer: Any) -> dict[str, dict]:
        """Lag, watermark delay and checkpoint age of every task this worker holds."""
        slice_seconds = self.settings.policy.windows.slice_seconds
        lag, delay, age = {}, {}, {}
        for (topic, partition), task in sorted(self._tasks.items()):
            highwater = consumer.highwater(TP(topic, partition))
            if highwater is not None and task.next_offset is not None:
                lag[(topic, partition)] = max(0, highwater - task.next_offset)
            if task.stage.watermark >= 0:
                delay[(topic, partition)] = now - (task.stage.watermark + 1) * slice_seconds
            if (topic, partition) in self._checkpointed_at:
                age[("stage1", partition)] = time.monotonic() - self._checkpointed_at[(topic, partition)]
        return {"lag": lag, "delay": delay, "age": age}

    async def _checkpoint(self, task: Stage1Task, tp: tuple[str, int]) -> None:
        await acknowledged(self._pending.pop(tp, []), "slice batches")  # what the checkpoint says was sent, was
        await self._checkpoints.save(_task_name("stage1", *tp), tp[1], task)
        self._checkpointed_at[tp] = time.monotonic()


# ---------------------------------------------------------------- stage 2


class Stage2Runner:
    """The I/O around stage 2: merge and decide, publish decisions through the outbox, archive, release silent sources."""

    def __init__(self, settings: StreamSettings, app: faust.App, writer: KafkaWriter,
                 checkpoints: CheckpointLog, reader: PartitionReader) -> None:
        self.settings = settings
        self._app = app
        self._writer = writer
        # Flag clients verify every decision against this keyring (see actions/signing.py);
        # without a configured key decisions go out unsigned and clients say so.
        self._keyring = Keyring.from_env()
        self._checkpoints = checkpoints
        self._reader = reader
        self._tasks: dict[int, Stage2Task] = {}
        self._lock = asyncio.Lock()  # the agent and the timers never work on a task at once
        self._assigned_at: dict[int, float] = {}
        self._checkpointed_at: dict[int, float] = {}
        self._heard: dict[tuple[int, str], float] = {}
        self._releasing: set[tuple[int, str]] = set()
        self._drain_checked_at = -float("inf")
        self._beats = 0
        self._archive = None
        self._archive_sink = None
        self.operations: Operations | None = None  # fed every final slice and every published decision
        self.decisions = 0
        self.slices = 0
        self.skipped = 0

    # -- archive ------------------------------------------------------------------------
    def open_archive(self) -> None:
        if self.settings.archive_dsn and self._archive is None:
            from specwatch.archive.store import Archive
            from specwatch.actions.handlers import ArchiveSink

            self._archive = Archive.open(self.settings.archive_dsn)
            self._archive_sink = ArchiveSink(self._archive)

    def close_archive(self) -> None:
        if self._archive is not None:
            self._archive_sink.close()
            self._archive.close()
            self._archive = self._archive_sink = None

    # -- events -------------------------------------------------------------------------
    async def handle(self, event: Any) -> None:
        message = event.message
        partition = message.partition
        async with self._lock:
            task = self._tasks.get(partition)
            if task is None:
                task = await self._take_over(partition)
            if message.offset < task.next_offset:
                self.skipped += 1
                return
            if message.offset > task.next_offset:
                await self._read_gap(task, partition, message.offset)
            await self._apply(task, partition, message.offset, message.value)
            if time.monotonic() - self._checkpointed_at.get(partition, 0.0) >= self.settings.checkpoint_seconds:
                await self._checkpoint(task, partition)

    async def _take_over(self, partition: int) -> Stage2Task:
        task = self._tasks[partition] = await self._restore(partition)
        if task.outbox:
            await self._finish_outbox(task, partition)
        # a sign of life as soon as a partition is taken over, not only at the next tick
        await self.heartbeat()
        return task

    async def _read_gap(self, task: Stage2Task, partition: int, upto: int) -> None:
        start = task.next_offset
        logger.info("%s reads offsets %d..%d that its checkpoint does not cover",
                    _task_name("stage2", self.settings.partials_topic, partition), start, upto - 1)
        async for old in self._reader.iter_range(self.settings.partials_topic, partition, start, upto):
            await self._apply(task, partition, old.offset, old.value)
            _acknowledge(self._app, old)
        task.next_offset = max(task.next_offset, upto)

    async def catch_up(self) -> None:
        """Owned partials partitions that delivered nothing since they were assigned: restore
        their tasks (finishing their outbox) and fold what the checkpoints do not cover, as
        `Stage1Runner.catch_up` does; a task must exist to release silent sources too."""
        assigned = {tp.partition for tp in self._app.consumer.assignment()
                    if tp.topic == self.settings.partials_topic}
        waiting = _overdue(assigned, self._tasks, self._assigned_at)
        if not waiting:
            return
        ends = await self._reader.end_offsets(self.settings.partials_topic)
        for partition in waiting:
            async with self._lock:
                if partition in self._tasks:
                    continue  # a message arrived meanwhile
                task = await self._take_over(partition)
                end = ends.get(partition, 0)
                if end > task.next_offset:
                    await self._read_gap(task, partition, end)
                    await self._checkpoint(task, partition)

    def forget(self, tps: Iterable[Any]) -> None:
        for tp in tps:
            if tp.topic == self.settings.partials_topic:
                self._tasks.pop(tp.partition, None)
                self._releasing = {k for k in self._releasing if k[0] != tp.partition}

    async def _restore(self, partition: int) -> Stage2Task:
        name = _task_name("stage2", self.settings.partials_topic, partition)
        task = await self._checkpoints.load(name, partition)
        now = time.monotonic()
        if isinstance(task, Stage2Task):
            logger.info("%s resumes from its checkpoint at offset %d", name, task.next_offset)
            self._checkpointed_at[partition] = now
        else:
            task = Stage2Task(self.settings.policy, self.settings.sources,
                              BundleOwner(partition, self.settings.partials_partitions))
            task.next_offset = await self._reader.beginning_offset(self.settings.partials_topic, partition)
        for source in task.watermarks:
            self._heard[(partition, source)] = now  # silence is counted from this worker's start
        return task

    async def _apply(self, task: Stage2Task, partition: int, offset: int, value: bytes) -> None:
        message = decode_partial(value or b"")
        if isinstance(message, Rejection):
            logger.warning("partials %d@%d dropped: %s", partition, offset, message.detail)
        elif message.batch is not None:
            key = (partition, message.batch.source)
            self._heard[key] = time.monotonic()
            self._releasing.discard(key)
        outputs = task.fold(offset, message)
        actions = []
        for output in outputs:
            self.slices += 1
            if self._archive_sink is not None:
                self._archive_sink(output)  # idempotent: a replayed slice writes the same rows
            if self.operations is not None:
                self.operations.view.observe(output, now=time.time())
            actions.extend(output.actions)
        if actions:
            # Into the checkpoint first, then out: a crash in between publishes the rest on restart.
            task.outbox = actions
            task.outbox_mark = await self._reader.end_offsets(self.settings.decisions_topic)
            await self._checkpoint(task, partition)
            await self._publish(task, actions)

    async def _finish_outbox(self, task: Stage2Task, partition: int) -> None:
        published = decisions_in(await self._reader.values_since(self.settings.decisions_topic, task.outbox_mark))
        missing = outbox_pending(task.outbox, published)
        logger.info("%s restarted with %d decisions in its outbox, %d not yet published",
                    _task_name("stage2", self.settings.partials_topic, partition), len(task.outbox), len(missing))
        await self._publish(task, missing)

    async def _publish(self, task: Stage2Task, actions: list) -> None:
        await self.publish_decisions([action.decision for action in actions])
        task.outbox = []
        task.outbox_mark = {}

    async def publish_decisions(self, decisions: list) -> None:
        """Sign and publish decisions on the decisions topic; return once the broker has them all."""
        sent = []
        for decision in decisions:
            key, value = decision_message(decision)
            sent.append(await self._writer.send(self.settings.decisions_topic, value, key=key,
                                                headers=sign_line(value, self._keyring)))
            logger.info("decision %s %s %s/%s/%s reason=%s ts=%.3f", decision.id, decision.action,
                        decision.bundle_id, decision.bucket or "*", decision.cohort or "*", decision.reason,
                        decision.ts)
        await acknowledged(sent, "decisions")
        self.decisions += len(sent)
        if self.operations is not None:
            self.operations.published(decisions)

    # -- what operations read -----------------------------------------------------------
    def cards(self) -> dict[str, dict]:
        """Bundle id -> card of every bundle the stage-2 tasks of this worker have seen."""
        return {bundle: card for task in self._tasks.values() for bundle, card in task.stage.cards.items()}

    def automatic(self, scope: tuple) -> Any:
        """The `ScopeState` this worker's decisions alone give ``scope`` (None: speculation on)."""
        for task in self._tasks.values():
            if scope[0] in task.stage.cards:
                return task.stage.flags.state(scope)
        return None

    def stages(self) -> list:
        """The `Stage2` of every task this worker holds (what the metrics view reads)."""
        return [task.stage for _, task in sorted(self._tasks.items())]

    def health(self, now: float, consumer: Any) -> dict:
        """Lag and checkpoint age per partials partition, the outbox, the archive spool."""
        lag, age = {}, {}
        for partition, task in sorted(self._tasks.items()):
            highwater = consumer.highwater(TP(self.settings.partials_topic, partition))
            if highwater is not None and task.next_offset is not None:
                lag[(self.settings.partials_topic, partition)] = max(0, highwater - task.next_offset)
            if partition in self._checkpointed_at:
                age[("stage2", partition)] = time.monotonic() - self._checkpointed_at[partition]
        spool = self._archive_sink.spool.pending_bytes if self._archive_sink is not None else None
        return {"lag": lag, "age": age, "outbox": sum(len(t.outbox) for t in self._tasks.values()),
                "spool": spool}

    async def _checkpoint(self, task: Stage2Task, partition: int) -> None:
        if self._archive_sink is not None:
            self._archive_sink.flush()  # the archive holds everything the checkpoint covers
        await self._checkpoints.save(_task_name("stage2", self.settings.partials_topic, partition), partition, task)
        self._checkpointed_at[partition] = time.monotonic()

    # -- signs of life ------------------------------------------------------------------
    async def heartbeat(self) -> None:
        """One signed heartbeat per partials partition this worker owns, with the event time decided up to.

        Flag clients tell a quiet fleet from a monitor that is gone by these; the publisher
        id is the partition, so a moved partition keeps its one compacted key.
        """
        slice_seconds = self.settings.policy.windows.slice_seconds
        for tp in sorted(self._app.consumer.assignment()):
            if tp.topic != self.settings.partials_topic:
                continue
            task = self._tasks.get(tp.partition)
            finalized = task.stage.finalized if task is not None else -1
            self._beats += 1
            key, value, headers = heartbeat_message(
                f"{self.settings.app_id}/stage2-{tp.partition}", self._beats,
                (finalized + 1) * slice_seconds if finalized >= 0 else None, keyring=self._keyring)
            await self._writer.send(self.settings.decisions_topic, value, key=key, headers=headers)

    # -- silent sources -----------------------------------------------------------------
    async def release_silent_sources(self) -> None:
        """Release telemetry partitions that hold slices back, sent nothing for a while, and have no data waiting.

        A partition with data waiting is never released, however long it is silent: its
        worker is restarting or behind, and its slices will come.
        """
        now = time.monotonic()
        silence = self.settings.source_silence_seconds
        candidates = []
        for partition, task in list(self._tasks.items()):
            def silent(source: str, partition: int = partition) -> bool:
                return now - self._heard.get((partition, source), now) >= silence
            candidates += [(partition, source, watermark) for source, watermark in task.silent_sources(silent)
                           if (partition, source) not in self._releasing]
        if not candidates or now - self._drain_checked_at < silence / 2:
            return
        self._drain_checked_at = now
        drained = await self._reader.drained(self.settings.app_id, {source for _, source, _ in candidates})
        released: dict[str, list[int]] = {}
        reported: set[str] = set()
        for partition, source, watermark in candidates:
            if source not in drained:
                continue
            self._releasing.add((partition, source))
            released.setdefault(source, []).append(partition)
            if source in self._tasks[partition].last_slice:
                reported.add(source)
            await self._writer.send(self.settings.partials_topic, encode_release(source, watermark),
                                    key=source.encode(), partition=partition)
        for source, partitions in sorted(released.items()):
            if source in reported:
                logger.warning("telemetry partition %s went silent with nothing left to read, %.0f s ago; stage 2 "
                               "partitions %s stop waiting for it (its later telemetry counts as late)",
                               source, silence, ", ".join(map(str, sorted(partitions))))
            else:
                logger.info("telemetry partition %s has no telemetry; stage 2 partitions %s do not wait for it",
                            source, ", ".join(map(str, sorted(partitions))))


def _overdue(assigned: set, tasks: Mapping, assigned_at: dict, now: float | None = None) -> list:
    """Assigned partitions without a task for `_CATCH_UP_AFTER_S` since first seen here, in order.

    ``assigned_at`` remembers when each was first seen and forgets those no longer assigned.

    >>> seen = {}
    >>> _overdue({1, 2}, {2: "task"}, seen, now=10.0), _overdue({1, 2}, {2: "task"}, seen, now=13.0)
    ([], [1])
    >>> _overdue({2}, {}, seen, now=14.0), sorted(seen)
    ([], [2])
    """
    now = time.monotonic() if now is None else now
    for key in list(assigned_at):
        if key not in assigned:
            del assigned_at[key]
    return [key for key in sorted(assigned) if key not in tasks
            and now - assigned_at.setdefault(key, now) >= _CATCH_UP_AFTER_S]


def _acknowledge(app: faust.App, record: Any) -> None:
    """Mark a message read outside the stream as done in Faust's consumer.

    Faust commits an offset only when every message before it was acknowledged; a message
    it never delivered (it drops some around rebalances and restarts) would hold the
    partition's commits back for good, though the task has folded it from a direct read.
    """
    app.consumer.ack(FaustMessage(record.topic, record.partition, record.offset, record.timestamp / 1000.0,
                                  record.timestamp_type, None, None, None, None,
                                  tp=TP(record.topic, record.partition)))


def _task_name(stage: str, topic: str, partition: int) -> str:
    return f"{stage}/{topic}/{partition}"


def _split_source(source: str) -> tuple[str, int]:
    topic, _, partition = source.rpartition("/")
    return topic, int(partition)


# ---------------------------------------------------------------- the app


@dataclass(frozen=True)
class StreamApp:
    """A Faust app with the runners its agents call."""

    app: faust.App
    stage1: Stage1Runner
    stage2: Stage2Runner
    operations: Operations


def create_app(settings: StreamSettings) -> StreamApp:
    """The Faust app for ``settings`` (from `prepare_topics`): topics, agents, timers.

    Faust runs the consumer group, the agents and the timers; checkpoints and every output
    go through the app's own producer (`KafkaWriter`), whose acknowledgements it can wait for.
    """
    if settings.telemetry_partitions < 1 or settings.partials_partitions < 1:
        raise ValueError("partition counts are unknown: pass the settings through prepare_topics() first")
    app = faust.App(
        settings.app_id,
        broker=[f"kafka://{server}" for server in settings.bootstrap.split(",")],
        broker_credentials=faust_credentials(settings.kafka_security),
        store="memory://",
        datadir=settings.data_dir,
        web_enabled=settings.operations.web_port is not None,
        web_port=settings.operations.web_port or 6066,
        web_bind=settings.operations.web_bind,
        autodiscover=False,
        topic_replication_factor=settings.replication_factor,
        topic_partitions=settings.partials_partitions,
        topic_disable_leader=False,
        broker_session_timeout=settings.session_timeout_seconds,
        broker_heartbeat_interval=max(1.0, settings.session_timeout_seconds / 10),
        consumer_auto_offset_reset="earliest",
        processing_guarantee="at_least_once",
        # An agent that fails stops the worker (and the exit code says so) instead of
        # restarting in a loop; whoever runs the workers restarts it from its checkpoint.
        agent_supervisor=CrashingSupervisor,
    )

    # -- topics the agents read ------------------------------------------------------------
    raw = {"key_type": bytes, "value_type": bytes, "key_serializer": "raw", "value_serializer": "raw"}
    telemetry = app.topic(*settings.telemetry_topics, **raw)
    partials = app.topic(settings.partials_topic, partitions=settings.partials_partitions, **raw)

    # -- state and outputs: checkpoint topics and the app's own producer ----------------------
    writer = KafkaWriter(settings.bootstrap, settings.kafka_security)
    reader = PartitionReader(settings.bootstrap, settings.kafka_security)
    stage1 = Stage1Runner(settings, app, writer, CheckpointLog(settings.checkpoint_topic("stage1"), writer, reader),
                          reader)
    stage2 = Stage2Runner(settings, app, writer, CheckpointLog(settings.checkpoint_topic("stage2"), writer, reader),
                          reader)

    # -- agents -------------------------------------------------------------------------
    @app.agent(telemetry, name="combine")
    async def combine(stream):
        async for event in stream.events():
            await stage1.handle(event)

    @app.agent(partials, name="decide")
    async def decide(stream):
        async for event in stream.events():
            await stage2.handle(event)

    # -- timers and lifecycle ---------------------------------------------------------------
    @app.timer(interval=_RELEASE_CHECK_SECONDS)
    async def release_silent_sources():
        await stage1.catch_up()
        await stage2.catch_up()
        await stage2.release_silent_sources()

    @app.timer(interval=_HEARTBEAT_SECONDS)
    async def publish_heartbeats():
        await stage2.heartbeat()

    operations = Operations(settings.operations, lambda: _service_health(app, stage1, stage2), stages=stage2.stages)
    stage2.operations = operations
    if settings.operations.web_port is not None:
        operations.install(app, ready=lambda: _ready(app), cards=stage2.cards, publish=stage2.publish_decisions,
                           automatic=stage2.automatic)

    progress = _Progress(stage1, stage2)

    @app.timer(interval=_PROGRESS_LOG_SECONDS)
    async def log_progress():
        progress.log()

    @app.on_partitions_revoked.connect
    async def on_revoked(app, revoked, **kwargs):
        stage1.forget(revoked)
        stage2.forget(revoked)

    @app.on_before_shutdown.connect
    async def on_shutdown(app, **kwargs):
        await writer.stop()

    return StreamApp(app, stage1, stage2, operations)


def _ready(app: faust.App) -> bool:
    """Ready once the worker holds partitions and is not rebalancing."""
    return bool(app.consumer.assignment()) and not app.rebalancing


def _service_health(app: faust.App, stage1: Stage1Runner, stage2: Stage2Runner) -> ServiceHealth:
    now = time.time()
    first = stage1.health(now, app.consumer)
    second = stage2.health(now, app.consumer)
    stage2.operations.view.engines_seen(stage1.engines_seen)
    return ServiceHealth(records_read=stage1.records, records_rejected=stage1.rejected.as_dict(),
                         consumer_lag={**first["lag"], **second["lag"]}, watermark_delay=first["delay"],
                         checkpoint_age={**first["age"], **second["age"]},
                         archive_spool_bytes=second["spool"], decisions_published=stage2.decisions,
                         decisions_outbox=second["outbox"], ready=_ready(app))


class _Progress:
    """One line per interval while work flows; nothing when idle."""

    def __init__(self, stage1: Stage1Runner, stage2: Stage2Runner) -> None:
        self._stage1 = stage1
        self._stage2 = stage2
        self._last = (0, 0, 0)
        self._at = time.monotonic()

    def log(self) -> None:
        now = time.monotonic()
        current = (self._stage1.records, self._stage2.slices, self._stage2.decisions)
        if current != self._last:
            records = current[0] - self._last[0]
            logger.info("%d records folded (%.0f/s), %d slices decided, %d decisions, %d rejected",
                        records, records / max(now - self._at, 1e-9), current[1] - self._last[1],
                        current[2] - self._last[2], self._stage1.rejected.total)
        self._last, self._at = current, now


def _log_task_stacks() -> None:
    import io

    tasks = asyncio.all_tasks()
    out = io.StringIO()
    for task in sorted(tasks, key=lambda t: t.get_name()):
        task.print_stack(limit=12, file=out)
    logger.warning("%d asyncio tasks:\n%s", len(tasks), out.getvalue())


def run_worker(settings: StreamSettings, loglevel: str = "warning") -> int:
    """Run one Faust worker in this process until it is stopped (SIGTERM/SIGINT); returns the exit code."""
    stream = create_app(settings)
    stream.stage2.open_archive()  # before joining the group: an archive in use fails fast
    worker = faust.Worker(stream.app, loglevel=loglevel, quiet=True, redirect_stdouts=False)
    worker.spinner = None  # a terminal progress spinner has no place in service logs

    @stream.app.task
    async def dump_tasks_on_sigusr1():
        # `kill -USR1 <pid>`: every asyncio task's stack to the log, to see what a quiet worker waits for
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, _log_task_stacks)

    stream.operations.start()
    try:
        worker.execute_from_commandline()
    except SystemExit as stop:
        return int(stop.code or 0)
    finally:
        stream.operations.stop()
        stream.stage2.close_archive()
    return 0
