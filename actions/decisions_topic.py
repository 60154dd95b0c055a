"""The compacted decisions topic: publishing decisions, and following them into local flag state.

Engines and routers run a `FlagClient`: it reads the topic from the beginning in a background
thread and answers ``lookup(bundle, bucket, cohort)`` from memory, never from the network.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import ValidationError

from specwatch.actions.flags import FlagStore, SpeculationState
from specwatch.collectors.otel import KafkaConfig
from specwatch.schemas import Decision

__all__ = [
    "DEFAULT_DECISIONS_TOPIC",
    "BrokerUnavailable",
    "DecisionPublisher",
    "DecisionReader",
    "FlagClient",
    "FlagClientStats",
    "decode_decision",
]

logger = logging.getLogger(__name__)

DEFAULT_DECISIONS_TOPIC = "specwatch.decisions"
_DEFAULT_CONNECT_TIMEOUT_S = 5.0
_DEFAULT_POLL_TIMEOUT_MS = 200
_DEFAULT_RETRY_BACKOFF_S = 1.0
_DEFAULT_MAX_RETRY_BACKOFF_S = 15.0
_DEFAULT_STOP_TIMEOUT_S = 5.0
_DEFAULT_FLUSH_TIMEOUT_S = 10.0
_DEFAULT_WARNING_INTERVAL_S = 30.0
# Decisions are a few hundred bytes and rare: wait little to batch, and fetch promptly.
_PUBLISH_LINGER_MS = 5
_FETCH_MAX_WAIT_MS = 100

T = TypeVar("T")


class BrokerUnavailable(ConnectionError):
    """Kafka could not be reached, or did not answer, within the connect timeout."""


def decode_decision(value: bytes | str | None) -> Decision | None:
    """A decision from a message value; None for a tombstone or anything that is not one.

    >>> line = Decision(ts=1.0, bundle_id="b-1", action="alert", reason="draft_overhead",
    ...                 detector="cost").to_json_line()
    >>> decode_decision(line.encode()).action, decode_decision(b"{oops"), decode_decision(None)
    ('alert', None, None)
    """
    if value is None:
        return None
    try:
        return Decision.model_validate_json(value)
    except (ValidationError, ValueError):
        return None


def _probe(bootstrap_servers: str, timeout_s: float) -> None:
    """Fail fast, with a plain message, when no bootstrap server accepts connections."""
    errors = []
    deadline = time.monotonic() + timeout_s
    for server in bootstrap_servers.split(","):
        host, _, port = server.strip().rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)),
                                          timeout=max(0.1, deadline - time.monotonic())):
                return
        except (OSError, ValueError) as error:
            errors.append(f"{server}: {error}")
    raise BrokerUnavailable(f"cannot reach Kafka at {bootstrap_servers} ({'; '.join(errors)})")


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


class DecisionPublisher:
    """Writes decisions to the compacted decisions topic: key = scope, value = contract line.

    `publish` hands the message to the producer and returns; `flush` waits for the broker.
    Failures are counted and logged, never raised into the policy loop.
    """

    def __init__(self, config: KafkaConfig, *, topic: str = DEFAULT_DECISIONS_TOPIC, producer: Any = None) -> None:
        self.topic = topic
        if producer is None:
            from kafka import KafkaProducer

            settings = config.producer_settings()
            settings.update(linger_ms=_PUBLISH_LINGER_MS, client_id=f"{config.client_id}-decisions")
            producer = KafkaProducer(**settings)
        self._producer = producer
        self._lock = threading.Lock()
        self._published = 0
        self._failed = 0

    def publish(self, decision: Decision) -> bool:
        """Queue one decision for the topic; False if the producer refused it."""
        try:
            future = self._producer.send(self.topic, key=decision.key.encode(),
                                         value=decision.to_json_line().encode())
        except Exception as error:  # noqa: BLE001 - broker away, closed producer
            self._failed_one(error)
            return False
        future.add_callback(self._delivered).add_errback(self._failed_one)
        return True

    def _delivered(self, _metadata: Any) -> None:
        with self._lock:
            self._published += 1

    def _failed_one(self, error: BaseException) -> None:
        with self._lock:
            self._failed += 1
        logger.warning("a decision was not published to %s: %s", self.topic, error)

    def flush(self, timeout_s: float = _DEFAULT_FLUSH_TIMEOUT_S) -> bool:
        """Wait until every queued decision is acknowledged or failed; False on timeout."""
        try:
            self._producer.flush(timeout=timeout_s)
        except Exception as error:  # noqa: BLE001 - KafkaTimeoutError
            logger.warning("decisions not flushed to %s within %g s: %s", self.topic, timeout_s, error)
            return False
        return True

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"published": self._published, "failed": self._failed}

    def close(self, timeout_s: float = _DEFAULT_FLUSH_TIMEOUT_S) -> None:
        try:
            self._producer.close(timeout=timeout_s)
        except Exception as error:  # noqa: BLE001
            logger.warning("decision producer did not close cleanly: %s", error)

    def __enter__(self) -> "DecisionPublisher":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class DecisionReader:
    """Reads a decisions topic from its beginning, each partition in offset order.

    ``connect()`` raises `BrokerUnavailable` (unreachable or silent cluster) or
    ``LookupError`` (no such topic) within ``connect_timeout_s``; then ``poll()`` returns
    ``(decision or None, message)`` pairs and ``caught_up`` says whether everything that
    was in the topic at connect time has been read.
    """

    def __init__(self, config: KafkaConfig, *, topic: str = DEFAULT_DECISIONS_TOPIC,
                 connect_timeout_s: float = _DEFAULT_CONNECT_TIMEOUT_S) -> None:
        self.config = config
        self.topic = topic
        self.connect_timeout_s = connect_timeout_s
        self._consumer: Any = None
        self._end_offsets: dict[Any, int] = {}

    def connect(self, resume_from: Mapping[int, int] | None = None) -> None:
        """Assign every partition; start each at ``resume_from[partition]`` or the beginning."""
        from kafka import KafkaConsumer, TopicPartition

        resume_from = resume_from or {}
        _probe(self.config.bootstrap_servers, self.connect_timeout_s)
        settings = self.config.client_settings()
        settings.update(group_id=None, enable_auto_commit=False, auto_offset_reset="earliest",
                        fetch_max_wait_ms=_FETCH_MAX_WAIT_MS, client_id=f"{self.config.client_id}-flags")
        consumer = KafkaConsumer(**settings)

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


@dataclass(frozen=True)
class FlagClientStats:
    applied: int
    changed: int
    undecodable: int
    tombstones: int
    connected: bool
    caught_up: bool
    reconnects: int


class FlagClient:
    """Follows the decisions topic in a background thread and keeps a `FlagStore` current.

    ``lookup`` answers from memory at any time (everything on until decisions arrive);
    ``wait_until_caught_up`` blocks until the topic's history has been applied. Messages
    that are not decisions are counted and skipped. The thread reconnects with backoff
    when the cluster goes away.

    Parameters
    ----------
    config
        The cluster; ``config.topic`` is not used, the decisions topic is ``topic``.
    store
        Where decisions are folded in; a new `FlagStore` by default.
    """

    def __init__(self, config: KafkaConfig, *, topic: str = DEFAULT_DECISIONS_TOPIC,
                 store: FlagStore | None = None, connect_timeout_s: float = _DEFAULT_CONNECT_TIMEOUT_S,
                 poll_timeout_ms: int = _DEFAULT_POLL_TIMEOUT_MS,
                 retry_backoff_s: float = _DEFAULT_RETRY_BACKOFF_S,
                 on_change: Callable[[Decision], None] | None = None) -> None:
        self.config = config
        self.topic = topic
        self.store = store if store is not None else FlagStore()
        self._connect_timeout_s = connect_timeout_s
        self._poll_timeout_ms = poll_timeout_ms
        self._retry_backoff_s = retry_backoff_s
        self._on_change = on_change
        self._stop = threading.Event()
        self._caught_up = threading.Event()
        self._thread: threading.Thread | None = None
        self._connected = False
        # Where to pick up after a reconnect: replaying history from the beginning would
        # flip flags back through old states for a moment.
        self._next_offsets: dict[int, int] = {}
        self._applied = self._changed = self._undecodable = self._tombstones = self._reconnects = 0

    def start(self) -> "FlagClient":
        if self._thread is not None:
            raise RuntimeError("FlagClient already started")
        self._thread = threading.Thread(target=self._run, name="specwatch-flag-client", daemon=True)
        self._thread.start()
        return self

    def lookup(self, bundle_id: str, bucket: str, cohort: str) -> SpeculationState:
        return self.store.lookup(bundle_id, bucket, cohort)

    def wait_until_caught_up(self, timeout_s: float | None = None) -> bool:
        return self._caught_up.wait(timeout_s)

    def stats(self) -> FlagClientStats:
        return FlagClientStats(self._applied, self._changed, self._undecodable, self._tombstones,
                               self._connected, self._caught_up.is_set(), self._reconnects)

    def stop(self, timeout_s: float = _DEFAULT_STOP_TIMEOUT_S) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("flag client thread did not stop within %g s", timeout_s)

    def __enter__(self) -> "FlagClient":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _run(self) -> None:
        backoff = self._retry_backoff_s
        last_warning = 0.0
        while not self._stop.is_set():
            reader = DecisionReader(self.config, topic=self.topic, connect_timeout_s=self._connect_timeout_s)
            try:
                reader.connect(resume_from=self._next_offsets)
                self._connected = True
                backoff = self._retry_backoff_s
                while not self._stop.is_set():
                    for decision, message in reader.poll(self._poll_timeout_ms):
                        self._fold(decision, message)
                    if not self._caught_up.is_set() and reader.caught_up:
                        self._caught_up.set()
                        logger.info("flag client caught up with %s: %d decisions applied",
                                    self.topic, self._applied)
            except Exception as error:  # noqa: BLE001 - keep following; flags stay as they were
                now = time.monotonic()
                if now - last_warning >= _DEFAULT_WARNING_INTERVAL_S:
                    logger.warning("flag client cannot follow %s (retrying every %.0f s at most): %s",
                                   self.topic, _DEFAULT_MAX_RETRY_BACKOFF_S, error)
                    last_warning = now
                self._stop.wait(backoff)
                backoff = min(backoff * 2, _DEFAULT_MAX_RETRY_BACKOFF_S)
            finally:
                if self._connected:
                    self._reconnects += 1
                self._connected = False
                reader.close()

    def _fold(self, decision: Decision | None, message: Any) -> None:
        self._next_offsets[message.partition] = message.offset + 1
        if decision is None:
            if message.value is None:
                self._tombstones += 1
            else:
                self._undecodable += 1
                logger.debug("skipping an undecodable message at %s[%d]@%d", message.topic,
                             message.partition, message.offset)
            return
        self._applied += 1
        if self.store.apply(decision):
            self._changed += 1
            if self._on_change is not None:
                try:
                    self._on_change(decision)
                except Exception:  # noqa: BLE001 - a listener bug must not stop flag updates
                    logger.exception("flag change listener failed")
