"""The decisions-topic publisher of the command line: signed decisions and heartbeats from a kafka-python producer.

Engines and routers follow the topic with `specwatch.collectors.flag_client.FlagClient`;
the stream workers send through the same `specwatch.transport.decision_sink.DecisionSink`
from aiokafka.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from specwatch.schemas import Decision
from specwatch.transport.codec import MAX_PUBLISHER_ID_CHARS
from specwatch.transport.config import KafkaConfig
from specwatch.transport.decision_sink import DecisionSink
from specwatch.transport.signing import Keyring
from specwatch.transport.topics import DECISIONS_TOPIC

__all__ = ["DecisionPublisher"]

logger = logging.getLogger(__name__)

_DEFAULT_FLUSH_TIMEOUT_S = 10.0
# Decisions are a few hundred bytes and rare: wait little to batch.
_PUBLISH_LINGER_MS = 5
# Three heartbeats fit in a flag client's default silence: one lost heartbeat never trips a client.
_DEFAULT_HEARTBEAT_INTERVAL_S = 10.0


def _default_publisher_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"[:MAX_PUBLISHER_ID_CHARS]


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

    def __init__(self, config: KafkaConfig, *, topic: str = DECISIONS_TOPIC, producer: Any = None,
                 keyring: Keyring | None = None, publisher_id: str | None = None) -> None:
        self.topic = topic
        self.keyring = keyring if keyring is not None else Keyring.from_env()
        self.publisher_id = publisher_id or _default_publisher_id()
        if producer is None:
            from kafka import KafkaProducer

            settings = config.producer_settings()
            settings.update(linger_ms=_PUBLISH_LINGER_MS, client_id=f"{config.client_id}-decisions")
            producer = KafkaProducer(**settings)
        self._producer = producer
        self._sink = DecisionSink(producer.send, topic, self.keyring)
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
        try:
            future = self._sink.decision(decision)
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
        try:
            future = self._sink.heartbeat(self.publisher_id, seq, watermark)
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
