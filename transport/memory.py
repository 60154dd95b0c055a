"""The in-memory twin of `PartitionReader` and `KafkaWriter`: topics with partitions, offsets and
retention (`MemoryKafka.expire`), in one process, for the partition runners' unit tests.

>>> import asyncio
>>> kafka = MemoryKafka({"t": 2})
>>> async def demo():
...     writer = MemoryWriter(kafka)
...     await writer.send("t", b"a", key=b"k", partition=1)
...     await writer.send("t", b"b", partition=1)
...     reader = MemoryReader(kafka)
...     return await reader.end_offsets("t"), [m.value for m in await reader.read("t", 1, 1, 2)]
>>> asyncio.run(demo())
({0: 0, 1: 2}, [b'b'])
"""

from __future__ import annotations

import asyncio
import time
import zlib
from dataclasses import dataclass, field
from typing import AsyncIterator, Iterable, Mapping

from .kafka_io import RangeReader, split_source

__all__ = ["MemoryKafka", "MemoryReader", "MemoryRecord", "MemoryWriter"]


@dataclass(frozen=True)
class MemoryRecord:
    """One message, with the fields of aiokafka's ``ConsumerRecord`` that the runners read."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...] = ()
    timestamp: int = 0  # milliseconds since the epoch, when it was appended (aiokafka's CreateTime)


@dataclass
class _Partition:
    start: int = 0  # the log start: offsets below it are gone (retention)
    records: list[MemoryRecord] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + len(self.records)


class MemoryKafka:
    """Topics in memory. ``topics`` maps each topic to its partition count; unknown topics get one partition."""

    def __init__(self, topics: Mapping[str, int] | None = None) -> None:
        self._topics: dict[str, list[_Partition]] = {}
        for topic, partitions in (topics or {}).items():
            self.create(topic, partitions)

    def create(self, topic: str, partitions: int) -> None:
        if partitions < 1:
            raise ValueError(f"a topic needs at least one partition, got {partitions}")
        self._topics.setdefault(topic, [_Partition() for _ in range(partitions)])

    def partitions(self, topic: str) -> list[_Partition]:
        if topic not in self._topics:
            self.create(topic, 1)
        return self._topics[topic]

    def append(self, topic: str, value: bytes | None, *, key: bytes | None = None, partition: int | None = None,
               headers: Iterable[tuple[str, bytes]] = ()) -> MemoryRecord:
        """Write one message; without a partition, the key picks one (crc32), as a keyed producer would."""
        partitions = self.partitions(topic)
        if partition is None:
            partition = zlib.crc32(key) % len(partitions) if key is not None else 0
        if not 0 <= partition < len(partitions):
            raise ValueError(f"topic {topic} has no partition {partition}")
        log = partitions[partition]
        record = MemoryRecord(topic, partition, log.end, key, value, tuple(headers), int(time.time() * 1000))
        log.records.append(record)
        return record

    def records(self, topic: str, partition: int) -> list[MemoryRecord]:
        """What the partition holds now, oldest first."""
        return list(self.partitions(topic)[partition].records)

    def topic_records(self, topic: str) -> list[MemoryRecord]:
        """Every message of ``topic``, partition by partition."""
        return [record for log in self.partitions(topic) for record in log.records]

    def expire(self, topic: str, partition: int, before: int) -> None:
        """Drop every message below offset ``before``, as retention does."""
        log = self.partitions(topic)[partition]
        drop = max(0, min(before, log.end) - log.start)
        del log.records[:drop]
        log.start += drop


class MemoryReader(RangeReader):
    """`PartitionReader` over a `MemoryKafka`."""

    def __init__(self, kafka: MemoryKafka) -> None:
        self._kafka = kafka

    async def partitions(self, topic: str) -> list[int]:
        return list(range(len(self._kafka.partitions(topic))))

    async def iter_range(self, topic: str, partition: int, start: int, end: int) -> AsyncIterator[MemoryRecord]:
        for record in self._kafka.records(topic, partition):
            if start <= record.offset < end:
                yield record

    async def beginning_offset(self, topic: str, partition: int) -> int:
        return self._kafka.partitions(topic)[partition].start

    async def end_offsets(self, topic: str) -> dict[int, int]:
        return {p: log.end for p, log in enumerate(self._kafka.partitions(topic))}

    async def drained(self, group: str, sources: Iterable[str]) -> set[str]:
        """The sources with nothing left to read (no group offsets here: the empty ones)."""
        logs = {source: self._kafka.partitions(topic)[partition]
                for source, (topic, partition) in ((s, split_source(s)) for s in sources)}
        return {source for source, log in logs.items() if log.end <= log.start}


class MemoryWriter:
    """`KafkaWriter` over a `MemoryKafka`: a send is in the log, and acknowledged, when it returns."""

    def __init__(self, kafka: MemoryKafka) -> None:
        self._kafka = kafka

    async def send(self, topic: str, value: bytes, *, key: bytes | None = None, partition: int | None = None,
                   headers: list[tuple[str, bytes]] | None = None) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        future.set_result(self._kafka.append(topic, value, key=key, partition=partition, headers=headers or ()))
        return future

    async def stop(self) -> None:
        pass

