"""The compacted decisions topic: publishing decisions, and following them into local flag state.

Engines and routers run a `FlagClient`: it reads the topic from the beginning in a background
thread and answers ``lookup(bundle, bucket, cohort)`` from memory, never from the network.

Messages are signed (`specwatch.actions.signing`): a client with a key acts only on
decisions signed by it. Publishers also send heartbeats (key ``__heartbeat__/<publisher>``)
so a client can tell a quiet fleet from a monitor that is gone, and fall back to a
configured safe state when the topic goes silent.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specwatch.actions.flags import FlagStore, SpeculationState
from specwatch.actions.signing import Keyring, Verdict, sign_line, verify
from specwatch.collectors.otel import KafkaConfig
from specwatch.schemas import Decision

__all__ = [
    "DEFAULT_DECISIONS_TOPIC",
    "FAIL_SAFES",
    "HEARTBEAT_KEY_PREFIX",
    "SILENT_FALLBACK",
    "BrokerUnavailable",
    "DecisionPublisher",
    "DecisionReader",
    "FlagClient",
    "FlagClientStats",
    "Heartbeat",
    "decode_decision",
    "decode_heartbeat",
    "heartbeat_message",
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
# Three heartbeats fit in the default silence: one lost heartbeat never trips a client.
_DEFAULT_HEARTBEAT_INTERVAL_S = 10.0
_DEFAULT_SILENCE_SECONDS = 30.0
_MAX_PUBLISHER_ID_CHARS = 200

HEARTBEAT_KEY_PREFIX = "__heartbeat__/"
FAIL_SAFES = ("keep_last", "standard_decoding")
SILENT_FALLBACK = SpeculationState(enabled=False, reasons=("decisions_silent",))
"""What `FlagClient.lookup` answers everywhere while silent with ``fail_safe="standard_decoding"``."""

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


class Heartbeat(BaseModel):
    """A publisher's sign of life on the decisions topic, signed like a decision.

    ``wall_time`` is the publisher's clock when it sent it (clients judge silence by it);
    ``watermark`` the event time the publisher's pipeline has reached (lag = wall - watermark).
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    kind: Literal["heartbeat"] = "heartbeat"
    v: Literal[1] = 1
    publisher: str = Field(min_length=1, max_length=_MAX_PUBLISHER_ID_CHARS)
    seq: int = Field(ge=0)
    wall_time: float = Field(ge=0, allow_inf_nan=False)
    watermark: float | None = Field(default=None, ge=0, allow_inf_nan=False)

    def to_json_line(self) -> str:
        return self.model_dump_json()

    @property
    def key(self) -> str:
        return HEARTBEAT_KEY_PREFIX + self.publisher


def decode_heartbeat(value: bytes | str | None) -> Heartbeat | None:
    """A heartbeat from a message value; None for anything that is not one.

    >>> key, value, headers = heartbeat_message("stage2-0", 3, 1700.5, keyring=Keyring(), wall_time=1800.0)
    >>> key, decode_heartbeat(value).watermark, headers
    (b'__heartbeat__/stage2-0', 1700.5, [])
    """
    if value is None:
        return None
    try:
        return Heartbeat.model_validate_json(value)
    except (ValidationError, ValueError):
        return None


def heartbeat_message(publisher_id: str, seq: int, watermark: float | None, *, keyring: Keyring,
                      wall_time: float | None = None) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
    """Key, value and signature headers of one heartbeat, ready for any Kafka producer.

    Parameters
    ----------
    publisher_id
        Names the publisher; one compacted key per publisher keeps the topic small.
    seq
        Heartbeats sent by this publisher so far (informational).
    watermark
        Event time the publisher's pipeline has reached, or None before any.
    keyring
        Signs the value (no headers without a key).
    wall_time
        The send time; now by default.
    """
    if watermark is not None and not math.isfinite(watermark):
        watermark = None
    beat = Heartbeat(publisher=publisher_id, seq=seq, watermark=watermark,
                     wall_time=time.time() if wall_time is None else wall_time)
    value = beat.to_json_line().encode("utf-8")
    return beat.key.encode("utf-8"), value, sign_line(value, keyring)


def _default_publisher_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"[:_MAX_PUBLISHER_ID_CHARS]


def _warn_unsigned(role: str) -> None:
    logger.warning("%s runs WITHOUT a signing key: anyone who can write the decisions topic can switch "
                   "speculation off or on. Set SPECWATCH_SIGNING_KEY_FILE (or SPECWATCH_SIGNING_KEY) on "
                   "publishers and flag clients alike.", role)


class DecisionPublisher:
    """Writes decisions to the compacted decisions topic: key = scope, value = contract line.

    Every message is signed with the keyring's current key (header ``specwatch-signature``).
    `publish` hands the message to the producer and returns; `flush` waits for the broker.
    Failures are counted and logged, never raised into the policy loop. `start_heartbeats`
    sends a signed heartbeat every few seconds from a background thread.

    Parameters
    ----------
    config
        The cluster.
    topic
        The decisions topic.
    producer
        A kafka-python producer to use instead of making one.
    keyring
        Signing keys; `Keyring.from_env()` by default. Without a key messages go out
        unsigned, with a warning.
    publisher_id
        Names this publisher in heartbeats; host and pid by default.
    """

    def __init__(self, config: KafkaConfig, *, topic: str = DEFAULT_DECISIONS_TOPIC, producer: Any = None,
                 keyring: Keyring | None = None, publisher_id: str | None = None) -> None:
        self.topic = topic
        self.keyring = keyring if keyring is not None else Keyring.from_env()
        self.publisher_id = publisher_id or _default_publisher_id()
        if not self.keyring.enabled:
            _warn_unsigned("the decision publisher")
        if producer is None:
            from kafka import KafkaProducer

            settings = config.producer_settings()
            settings.update(linger_ms=_PUBLISH_LINGER_MS, client_id=f"{config.client_id}-decisions")
            producer = KafkaProducer(**settings)
        self._producer = producer
        self._lock = threading.Lock()
        self._published = 0
        self._failed = 0
        self._beats = 0
        self._beats_failed = 0
        self._watermark: float | None = None
        self._beat_stop = threading.Event()
        self._beat_thread: threading.Thread | None = None

    def publish(self, decision: Decision) -> bool:
        """Queue one decision for the topic; False if the producer refused it."""
        value = decision.to_json_line().encode()
        try:
            future = self._producer.send(self.topic, key=decision.key.encode(), value=value,
                                         headers=sign_line(value, self.keyring))
        except Exception as error:  # noqa: BLE001 - broker away, closed producer
            self._failed_one(error)
            return False
        with self._lock:
            if self._watermark is None or decision.ts > self._watermark:
                self._watermark = decision.ts
        future.add_callback(self._delivered).add_errback(self._failed_one)
        return True

    def heartbeat(self, watermark: float | None = None) -> bool:
        """Queue one heartbeat; ``watermark`` defaults to the latest decision time published."""
        with self._lock:
            seq = self._beats + self._beats_failed
            if watermark is None:
                watermark = self._watermark
        key, value, headers = heartbeat_message(self.publisher_id, seq, watermark, keyring=self.keyring)
        try:
            future = self._producer.send(self.topic, key=key, value=value, headers=headers)
        except Exception as error:  # noqa: BLE001
            self._beat_failed(error)
            return False
        future.add_callback(self._beat_delivered).add_errback(self._beat_failed)
        return True

    def start_heartbeats(self, interval_s: float = _DEFAULT_HEARTBEAT_INTERVAL_S,
                         watermark: Callable[[], float | None] | None = None) -> None:
        """Send a heartbeat now and every ``interval_s`` until `close`.

        ``watermark`` is asked for the pipeline's event-time watermark before each one.
        """
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        if self._beat_thread is not None:
            raise RuntimeError("heartbeats already started")

        def beat() -> None:
            while True:
                try:
                    self.heartbeat(watermark() if watermark is not None else None)
                except Exception:  # noqa: BLE001 - a watermark bug must not end the heartbeats
                    logger.exception("heartbeat on %s failed", self.topic)
                if self._beat_stop.wait(interval_s):
                    return

        self._beat_thread = threading.Thread(target=beat, name="specwatch-decision-heartbeat", daemon=True)
        self._beat_thread.start()

    def _delivered(self, _metadata: Any) -> None:
        with self._lock:
            self._published += 1

    def _failed_one(self, error: BaseException) -> None:
        with self._lock:
            self._failed += 1
        logger.warning("a decision was not published to %s: %s", self.topic, error)

    def _beat_delivered(self, _metadata: Any) -> None:
        with self._lock:
            self._beats += 1

    def _beat_failed(self, error: BaseException) -> None:
        with self._lock:
            self._beats_failed += 1
            failed = self._beats_failed
        # Heartbeats keep coming while the broker is away: say so now and then, not each time.
        if failed == 1 or failed % 60 == 0:
            logger.warning("heartbeat not published to %s (%d failed so far): %s", self.topic, failed, error)

    def flush(self, timeout_s: float = _DEFAULT_FLUSH_TIMEOUT_S) -> bool:
        """Wait until every queued decision is acknowledged or failed; False on timeout."""
        try:
            self._producer.flush(timeout=timeout_s)
        except Exception as error:  # noqa: BLE001 - KafkaTimeoutError
            logger.warning("decisions not flushed to %s within %g s: %s", self.topic, timeout_s, error)
            return False
        return True

    def stats(self) -> dict[str, int]:
        """Decisions acknowledged and failed."""
        with self._lock:
            return {"published": self._published, "failed": self._failed}

    def heartbeat_stats(self) -> dict[str, int]:
        """Heartbeats acknowledged and failed."""
        with self._lock:
            return {"heartbeats": self._beats, "failed": self._beats_failed}

    def close(self, timeout_s: float = _DEFAULT_FLUSH_TIMEOUT_S) -> None:
        self._beat_stop.set()
        if self._beat_thread is not None:
            self._beat_thread.join(timeout_s)
        try:
            self._producer.close(timeout=timeout_s)
        except Exception as error:  # noqa: BLE001
            logger.warning("decision producer did not close cleanly: %s", error)

    def __enter__(self) -> "DecisionPublisher":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _is_heartbeat_key(key: bytes | None) -> bool:
    return key is not None and key.startswith(HEARTBEAT_KEY_PREFIX.encode())


class DecisionReader:
    """Reads a decisions topic from its beginning, each partition in offset order.

    ``connect()`` raises `BrokerUnavailable` (unreachable or silent cluster) or
    ``LookupError`` (no such topic) within ``connect_timeout_s``; then ``poll()`` returns
    ``(decision or None, message)`` pairs and ``caught_up`` says whether everything that
    was in the topic at connect time has been read. Heartbeats (keys under
    ``__heartbeat__/``) are left out unless ``include_heartbeats``. The reader does not
    check signatures: `FlagClient` does, before it acts on anything.
    """

    def __init__(self, config: KafkaConfig, *, topic: str = DEFAULT_DECISIONS_TOPIC,
                 connect_timeout_s: float = _DEFAULT_CONNECT_TIMEOUT_S, include_heartbeats: bool = False) -> None:
        self.config = config
        self.topic = topic
        self.connect_timeout_s = connect_timeout_s
        self.include_heartbeats = include_heartbeats
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
        if not self.include_heartbeats:
            messages = [m for m in messages if not _is_heartbeat_key(m.key)]
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
    """Counters of one `FlagClient` since it started.

    ``forged``, ``unsigned``, ``replayed`` and ``misrouted`` count messages ignored for
    their signature, a decision older than the one in force for its scope (or a
    heartbeat not newer than its publisher's last), or a key that does not match the
    value. ``silent`` is whether the topic is silent now, ``silences`` how many times
    it went silent; ``watermark`` the latest event time a publisher reported.
    """

    applied: int
    changed: int
    undecodable: int
    tombstones: int
    connected: bool
    caught_up: bool
    reconnects: int
    heartbeats: int = 0
    forged: int = 0
    unsigned: int = 0
    replayed: int = 0
    misrouted: int = 0
    stale_heartbeats: int = 0
    silent: bool = False
    silences: int = 0
    watermark: float | None = None


class FlagClient:
    """Follows the decisions topic in a background thread and keeps a `FlagStore` current.

    ``lookup`` answers from memory at any time (everything on until decisions arrive);
    ``wait_until_caught_up`` blocks until the topic's history has been applied. Messages
    that are not decisions are counted and skipped. The thread reconnects with backoff
    when the cluster goes away.

    With a signing key, only messages signed by the current or previous key count; the
    rest are counted and ignored, as is any decision older than the one already in force
    for its scope (a replay). The topic is *silent* when no fresh heartbeat or decision
    arrived for ``silence_seconds``; what happens then is the ``fail_safe``.

    Parameters
    ----------
    config
        The cluster; ``config.topic`` is not used, the decisions topic is ``topic``.
    store
        Where decisions are folded in; a new `FlagStore` by default.
    keyring
        Keys to check signatures with; `Keyring.from_env()` by default. Without a key
        every message is accepted, with a warning.
    silence_seconds
        How long without a fresh heartbeat or decision makes the topic silent; None: never.
    fail_safe
        ``"keep_last"``: while silent, keep answering from the last known state.
        ``"standard_decoding"``: while silent, answer speculation off everywhere
        (`SILENT_FALLBACK`) until heartbeats resume.
    clock, wall_clock
        Monotonic and unix clocks, passed in so tests can drive time. Heartbeats carry
        the publisher's unix time: the two hosts' clocks must agree to well under
        ``silence_seconds`` (NTP).
    """

    def __init__(self, config: KafkaConfig, *, topic: str = DEFAULT_DECISIONS_TOPIC,
                 store: FlagStore | None = None, connect_timeout_s: float = _DEFAULT_CONNECT_TIMEOUT_S,
                 poll_timeout_ms: int = _DEFAULT_POLL_TIMEOUT_MS,
                 retry_backoff_s: float = _DEFAULT_RETRY_BACKOFF_S,
                 on_change: Callable[[Decision], None] | None = None,
                 keyring: Keyring | None = None,
                 silence_seconds: float | None = _DEFAULT_SILENCE_SECONDS,
                 fail_safe: str = "keep_last",
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        if fail_safe not in FAIL_SAFES:
            raise ValueError(f"fail_safe must be one of {', '.join(FAIL_SAFES)}, got {fail_safe!r}")
        if silence_seconds is not None and not silence_seconds > 0:
            raise ValueError(f"silence_seconds must be positive (or None to never go silent), got {silence_seconds}")
        self.config = config
        self.topic = topic
        self.store = store if store is not None else FlagStore()
        self.keyring = keyring if keyring is not None else Keyring.from_env()
        self.silence_seconds = silence_seconds
        self.fail_safe = fail_safe
        if not self.keyring.enabled:
            _warn_unsigned("the flag client")
        self._connect_timeout_s = connect_timeout_s
        self._poll_timeout_ms = poll_timeout_ms
        self._retry_backoff_s = retry_backoff_s
        self._on_change = on_change
        self._clock = clock
        self._wall_clock = wall_clock
        self._stop = threading.Event()
        self._caught_up = threading.Event()
        self._thread: threading.Thread | None = None
        self._connected = False
        # Where to pick up after a reconnect: replaying history from the beginning would
        # flip flags back through old states for a moment.
        self._next_offsets: dict[int, int] = {}
        self._applied = self._changed = self._undecodable = self._tombstones = self._reconnects = 0
        self._heartbeats = self._forged = self._unsigned = self._replayed = self._misrouted = 0
        self._stale_heartbeats = self._silences = 0
        # Replay defence: the newest decision time applied per scope, the newest heartbeat
        # time per publisher. Decisions of one scope come from one stage-2 task, in order.
        self._latest_ts: dict[tuple[str, str | None, str | None], float] = {}
        self._latest_beat: dict[str, float] = {}
        self._watermark: float | None = None
        self._state_lock = threading.Lock()
        self._last_heard = clock()  # silence is counted from the client's start
        self._silent = False
        self._last_rejection_warning = -float("inf")

    def start(self) -> "FlagClient":
        if self._thread is not None:
            raise RuntimeError("FlagClient already started")
        self._last_heard = self._clock()
        self._thread = threading.Thread(target=self._run, name="specwatch-flag-client", daemon=True)
        self._thread.start()
        return self

    def lookup(self, bundle_id: str, bucket: str, cohort: str) -> SpeculationState:
        if self.fail_safe == "standard_decoding" and self.silent:
            return SILENT_FALLBACK
        return self.store.lookup(bundle_id, bucket, cohort)

    @property
    def silent(self) -> bool:
        """Whether no fresh heartbeat or decision arrived for ``silence_seconds``."""
        if self.silence_seconds is None:
            return False
        silent = self._clock() - self._last_heard >= self.silence_seconds
        if silent != self._silent:
            self._transition(silent)
        return silent

    def wait_until_caught_up(self, timeout_s: float | None = None) -> bool:
        return self._caught_up.wait(timeout_s)

    def stats(self) -> FlagClientStats:
        silent = self.silent
        return FlagClientStats(self._applied, self._changed, self._undecodable, self._tombstones,
                               self._connected, self._caught_up.is_set(), self._reconnects,
                               self._heartbeats, self._forged, self._unsigned, self._replayed, self._misrouted,
                               self._stale_heartbeats, silent, self._silences, self._watermark)

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
            reader = DecisionReader(self.config, topic=self.topic, connect_timeout_s=self._connect_timeout_s,
                                    include_heartbeats=True)
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
                    self.silent  # noqa: B018 - logs a transition even when nobody looks up
            except Exception as error:  # noqa: BLE001 - keep following; flags stay as they were
                now = time.monotonic()
                if now - last_warning >= _DEFAULT_WARNING_INTERVAL_S:
                    logger.warning("flag client cannot follow %s (retrying every %.0f s at most): %s",
                                   self.topic, _DEFAULT_MAX_RETRY_BACKOFF_S, error)
                    last_warning = now
                self.silent  # noqa: B018
                self._stop.wait(backoff)
                backoff = min(backoff * 2, _DEFAULT_MAX_RETRY_BACKOFF_S)
            finally:
                if self._connected:
                    self._reconnects += 1
                self._connected = False
                reader.close()

    def _fold(self, decision: Decision | None, message: Any) -> None:
        self._next_offsets[message.partition] = message.offset + 1
        value = message.value
        if value is None:
            self._tombstones += 1
            return
        verdict = verify(value, message.headers, self.keyring)
        if not verdict.accepted:
            if verdict is Verdict.UNSIGNED:
                self._unsigned += 1
            else:
                self._forged += 1
            self._rejected(verdict.value, message)
            return
        if decision is None:
            beat = decode_heartbeat(value)
            if beat is not None:
                self._heartbeat(beat, message)
                return
            self._undecodable += 1
            logger.debug("skipping an undecodable message at %s[%d]@%d", message.topic,
                         message.partition, message.offset)
            return
        if message.key is not None and message.key != decision.key.encode():
            # The signature covers the value only; a decision under another scope's key
            # would survive compaction of the scope it names.
            self._misrouted += 1
            self._rejected("misrouted", message)
            return
        scope = (decision.bundle_id, decision.bucket, decision.cohort)
        latest = self._latest_ts.get(scope)
        if latest is not None and decision.ts < latest:
            self._replayed += 1
            self._rejected("replayed", message)
            return
        self._latest_ts[scope] = decision.ts
        self._heard_at(message.timestamp / 1000.0 if message.timestamp is not None else None)
        self._applied += 1
        if self.store.apply(decision):
            self._changed += 1
            if self._on_change is not None:
                try:
                    self._on_change(decision)
                except Exception:  # noqa: BLE001 - a listener bug must not stop flag updates
                    logger.exception("flag change listener failed")

    def _heartbeat(self, beat: Heartbeat, message: Any) -> None:
        if message.key is not None and message.key != beat.key.encode():
            self._misrouted += 1
            self._rejected("misrouted", message)
            return
        latest = self._latest_beat.get(beat.publisher)
        if latest is not None and beat.wall_time <= latest:
            self._replayed += 1
            self._rejected("replayed", message)
            return
        self._latest_beat[beat.publisher] = beat.wall_time
        self._heartbeats += 1
        if beat.watermark is not None and (self._watermark is None or beat.watermark > self._watermark):
            self._watermark = beat.watermark
        if not self._heard_at(beat.wall_time):
            self._stale_heartbeats += 1  # history read at start, or a publisher far behind

    def _heard_at(self, wall_time: float | None) -> bool:
        """Count a message sent at ``wall_time`` as a sign of life, if it is recent enough."""
        if wall_time is None:
            return False
        if self.silence_seconds is None:
            return True
        age = max(0.0, self._wall_clock() - wall_time)
        if age >= self.silence_seconds:
            return False
        heard = self._clock() - age
        with self._state_lock:
            if heard > self._last_heard:
                self._last_heard = heard
        self.silent  # noqa: B018 - logs the way back from silence at once
        return True

    def _transition(self, silent: bool) -> None:
        with self._state_lock:
            if silent == self._silent:
                return  # another thread logged it
            self._silent = silent
            if silent:
                self._silences += 1
        if silent:
            logger.warning("no heartbeat or decision on %s for %.0f s: the monitor is silent; %s", self.topic,
                           self.silence_seconds, "speculation is OFF everywhere until it resumes"
                           if self.fail_safe == "standard_decoding" else "keeping the last known flags")
        else:
            logger.warning("heartbeats on %s resumed: flags answer from decisions again", self.topic)

    def _rejected(self, why: str, message: Any) -> None:
        # Never the value: it is attacker-controlled. Rate-limited: a flood must not flood logs.
        now = self._clock()
        if now - self._last_rejection_warning >= _DEFAULT_WARNING_INTERVAL_S:
            self._last_rejection_warning = now
            logger.warning("ignored a %s message at %s[%d]@%d (so far: %d forged, %d unsigned, %d replayed, "
                           "%d misrouted)", why, message.topic, message.partition, message.offset,
                           self._forged, self._unsigned, self._replayed, self._misrouted)
