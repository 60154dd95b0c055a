"""Reading and writing Kafka partitions from asyncio: ranges outside the consumer group, and
awaited writes (`specwatch.transport.memory` is the in-memory twin of both)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Iterable, Mapping

from aiokafka import TopicPartition

from .clients import FROM_EARLIEST, aiokafka_admin, aiokafka_consumer, aiokafka_producer
from .config import KafkaConfig

__all__ = ["KafkaStalled", "KafkaWriter", "PartitionReader", "RangeReader", "acknowledged", "split_source"]

_CONNECT_TIMEOUT_MS = 10_000
# How long a send may wait for the broker's acknowledgement before the worker gives up
# and exits (to restart from its checkpoint) rather than hang.
_ACK_TIMEOUT_S = 60.0
_READ_POLL_MS = 500
_READ_BATCH = 500
# Checkpoint chunks are 512 KiB; partials messages and decisions far smaller.
_MAX_REQUEST_BYTES = 2 << 20


def split_source(source: str) -> tuple[str, int]:
    """``topic/partition`` -> (topic, partition).

    >>> split_source("specwatch.telemetry/3")
    ('specwatch.telemetry', 3)
    """
    topic, _, partition = source.rpartition("/")
    return topic, int(partition)


class RangeReader:
    """What every partition reader derives from `iter_range` and `end_offsets`."""

    def iter_range(self, topic: str, partition: int, start: int, end: int) -> AsyncIterator[Any]:
        raise NotImplementedError

    async def end_offsets(self, topic: str) -> dict[int, int]:
        raise NotImplementedError

    async def read(self, topic: str, partition: int, start: int, end: int) -> list[Any]:
        return [message async for message in self.iter_range(topic, partition, start, end)]

    async def values_since(self, topic: str, marks: dict[int, int]) -> list[bytes]:
        """Values written to ``topic`` after ``marks`` (partition -> offset), up to its current end."""
        ends = await self.end_offsets(topic)
        values: list[bytes] = []
        for partition, end in sorted(ends.items()):
            for message in await self.read(topic, partition, marks.get(partition, 0), end):
                values.append(message.value)
        return values


class PartitionReader(RangeReader):
    """Reads ranges of partitions outside the consumer group: gaps after a restart, the decisions tail."""

    def __init__(self, bootstrap: str, security: Mapping[str, Any] | None = None, *,
                 fetch: Mapping[str, Any] | None = None) -> None:
        self._bootstrap = bootstrap
        self._security = dict(security or {})
        self._fetch = dict(fetch or {})  # `KafkaConfig.aiokafka_fetch_settings`
        self._partitions: dict[str, list[int]] = {}

    async def partitions(self, topic: str) -> list[int]:
        """Partition ids of ``topic`` (asked once: partitions are only ever added by hand)."""
        if topic not in self._partitions:
            async with self._admin() as admin:
                described = await admin.describe_topics([topic])
            found = [p["partition"] for d in described if d["topic"] == topic and not d.get("error_code")
                     for p in d["partitions"]]
            if not found:
                return []
            self._partitions[topic] = sorted(found)
        return self._partitions[topic]

    @contextlib.asynccontextmanager
    async def _admin(self) -> AsyncIterator[Any]:
        admin = aiokafka_admin(self._bootstrap, security=self._security, request_timeout_ms=_CONNECT_TIMEOUT_MS)
        await admin.start()
        try:
            yield admin
        finally:
            await admin.close()

    def _consumer(self) -> Any:
        """A consumer outside any group, started and stopped by ``async with``."""
        return aiokafka_consumer(self._bootstrap, security=self._security, fetch=self._fetch, **FROM_EARLIEST,
                                 isolation_level="read_committed")

    async def iter_range(self, topic: str, partition: int, start: int, end: int) -> AsyncIterator[Any]:
        """Messages with ``start <= offset < end`` of one partition, in order (fewer if the log ends first)."""
        if end <= start:
            return
        tp = TopicPartition(topic, partition)
        async with self._consumer() as consumer:
            consumer.assign([tp])
            consumer.seek(tp, start)
            end = min(end, (await consumer.end_offsets([tp]))[tp])
            while await consumer.position(tp) < end:
                batch = await consumer.getmany(tp, timeout_ms=_READ_POLL_MS, max_records=_READ_BATCH)
                for message in batch.get(tp, []):
                    if message.offset >= end:
                        return
                    yield message

    async def beginning_offset(self, topic: str, partition: int) -> int:
        tp = TopicPartition(topic, partition)
        async with self._consumer() as consumer:
            return (await consumer.beginning_offsets([tp]))[tp]

    async def end_offsets(self, topic: str) -> dict[int, int]:
        partitions = await self.partitions(topic)
        if not partitions:
            return {}
        async with self._consumer() as consumer:
            offsets = await consumer.end_offsets([TopicPartition(topic, p) for p in partitions])
        return {tp.partition: offset for tp, offset in offsets.items()}

    async def drained(self, group: str, sources: Iterable[str]) -> set[str]:
        """The sources (``topic/partition``) with nothing left to read: all committed by ``group``, or empty."""
        tps = {source: TopicPartition(*split_source(source)) for source in sources}
        if not tps:
            return set()
        async with self._admin() as admin:
            committed = await admin.list_consumer_group_offsets(group, partitions=list(tps.values()))
        async with self._consumer() as consumer:
            begin = await consumer.beginning_offsets(list(tps.values()))
            end = await consumer.end_offsets(list(tps.values()))
        out = set()
        for source, tp in tps.items():
            mark = committed.get(tp)
            if end[tp] <= begin[tp] or (mark is not None and mark.offset >= end[tp]):
                out.add(source)
        return out


class KafkaStalled(RuntimeError):
    """The broker did not acknowledge what this worker sent; it stops rather than hang."""


class KafkaWriter:
    """The app's own idempotent producer (``acks=all``): each send can be awaited till acknowledged.
    Faust's producer flush gives up after a moment, no ground for "written before published"."""

    def __init__(self, config: KafkaConfig) -> None:
        self._settings = config.aiokafka_producer_settings(
            acks="all", enable_idempotence=True, max_request_size=max(config.max_request_size, _MAX_REQUEST_BYTES))
        self._producer: Any = None

    async def send(self, topic: str, value: bytes, *, key: bytes | None = None, partition: int | None = None,
                   headers: list[tuple[str, bytes]] | None = None) -> asyncio.Future:
        """Hand one message to the producer; the returned future resolves when the broker acknowledged it."""
        if self._producer is None:
            producer = aiokafka_producer(self._settings)
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
