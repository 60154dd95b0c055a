"""Reading the decisions topic from its beginning, with deadlines kafka-python does not keep by itself."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from specwatch.schemas import Decision

from .clients import kafka_consumer, probe_bootstrap
from .codec import decode_decision, is_heartbeat_key
from .config import BrokerUnavailable, KafkaConfig
from .topics import DECISIONS_TOPIC

__all__ = ["DecisionReader"]

logger = logging.getLogger(__name__)

_DEFAULT_CONNECT_TIMEOUT_S = 5.0
_DEFAULT_POLL_TIMEOUT_MS = 200
# Decisions are a few hundred bytes and rare: fetch promptly.
_FETCH_MAX_WAIT_MS = 100

T = TypeVar("T")


def _within(timeout_s: float, what: str, call: Callable[[], T]) -> T:
    """Run a blocking client call with a deadline; kafka-python's own waits can be unbounded."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = error

    worker = threading.Thread(target=run, name="specwatch-kafka-call", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise BrokerUnavailable(f"Kafka did not answer {what} within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


class DecisionReader:
    """Reads a decisions topic from its start, each partition in offset order; checks no signatures.
    ``connect()`` raises `BrokerUnavailable` or ``LookupError`` (no such topic) within
    ``connect_timeout_s``; ``poll()`` returns ``(decision or None, message)`` pairs; heartbeats only
    with ``include_heartbeats``."""

    def __init__(self, config: KafkaConfig, *, topic: str = DECISIONS_TOPIC,
                 connect_timeout_s: float = _DEFAULT_CONNECT_TIMEOUT_S, include_heartbeats: bool = False) -> None:
        self.config = config
        self.topic = topic
        self.connect_timeout_s = connect_timeout_s
        self.include_heartbeats = include_heartbeats
        self._consumer: Any = None
        self._end_offsets: dict[Any, int] = {}

    def connect(self, resume_from: Mapping[int, int] | None = None) -> None:
        """Assign every partition; start each at ``resume_from[partition]`` or the beginning."""
        from kafka import TopicPartition

        resume_from = resume_from or {}
        probe_bootstrap(self.config.bootstrap_servers, self.connect_timeout_s)
        consumer = kafka_consumer(self.config, group_id=None, enable_auto_commit=False, auto_offset_reset="earliest",
                                  fetch_max_wait_ms=_FETCH_MAX_WAIT_MS, client_id=f"{self.config.client_id}-flags")

        def discover() -> dict[Any, int]:
            consumer.bootstrap()
            partitions = consumer.partitions_for_topic(self.topic)
            if not partitions:
                raise LookupError(f"topic {self.topic} does not exist on {self.config.bootstrap_servers}")
            assigned = [TopicPartition(self.topic, p) for p in sorted(partitions)]
            consumer.assign(assigned)
            for tp in assigned:
                if tp.partition in resume_from:
                    consumer.seek(tp, resume_from[tp.partition])
                else:
                    consumer.seek_to_beginning(tp)
            return consumer.end_offsets(assigned)

        try:
            self._end_offsets = _within(self.connect_timeout_s, f"for topic {self.topic}", discover)
        except BaseException:
            # Closing can wait on the same silent cluster: do it off the caller's thread.
            threading.Thread(target=consumer.close, kwargs={"autocommit": False}, daemon=True).start()
            raise
        self._consumer = consumer

    def poll(self, timeout_ms: int = _DEFAULT_POLL_TIMEOUT_MS) -> list[tuple[Decision | None, Any]]:
        batches = self._consumer.poll(timeout_ms=timeout_ms)
        messages = [m for partition in sorted(batches, key=lambda tp: tp.partition) for m in batches[partition]]
        if len(batches) > 1:  # several partitions: interleave by time, keep each partition's order
            messages.sort(key=lambda m: (m.timestamp, m.partition, m.offset))
        if not self.include_heartbeats:
            messages = [m for m in messages if not is_heartbeat_key(m.key)]
        return [(decode_decision(m.value), m) for m in messages]

    @property
    def caught_up(self) -> bool:
        consumer = self._consumer
        if consumer is None:
            return False
        timeout_ms = int(self.connect_timeout_s * 1000)
        return all(consumer.position(tp, timeout_ms=timeout_ms) >= end for tp, end in self._end_offsets.items())

    def __iter__(self) -> Iterator[tuple[Decision | None, Any]]:
        """Everything up to the end as of connect time, then stops."""
        while not self.caught_up:
            yield from self.poll()

    def close(self) -> None:
        if self._consumer is not None:
            consumer, self._consumer = self._consumer, None
            try:
                consumer.close(autocommit=False)
            except Exception as error:  # noqa: BLE001
                logger.debug("decision consumer did not close cleanly: %s", error)
