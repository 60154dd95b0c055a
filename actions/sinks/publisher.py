"""The decisions-topic publisher of the command line: signed decisions from a kafka-python producer,
through the `DecisionSink` the stream workers use from aiokafka."""

from __future__ import annotations

import logging
import threading
from typing import Any

from specwatch.schemas import Decision
from specwatch.transport.clients import kafka_producer
from specwatch.transport.config import KafkaConfig
from specwatch.transport.codec import DecisionSink
from specwatch.transport.signing import Keyring
from specwatch.transport.topics import DECISIONS_TOPIC

__all__ = ["DecisionPublisher"]

logger = logging.getLogger(__name__)

_DEFAULT_FLUSH_TIMEOUT_S = 10.0
# Decisions are a few hundred bytes and rare: wait little to batch.
_PUBLISH_LINGER_MS = 5


class DecisionPublisher:
    """Writes signed decisions to the compacted decisions topic (key: scope, value: contract line);
    failures are counted and logged, never raised. Without a signing key in ``keyring``
    (`Keyring.from_env()` by default) messages go out unsigned, with a warning."""

    def __init__(self, config: KafkaConfig, *, topic: str = DECISIONS_TOPIC,
                 keyring: Keyring | None = None) -> None:
        self.topic = topic
        self.keyring = keyring if keyring is not None else Keyring.from_env()
        self._producer = kafka_producer(config, linger_ms=_PUBLISH_LINGER_MS, client_id=f"{config.client_id}-decisions")
        self._sink = DecisionSink(self._producer.send, topic, self.keyring)
        self._lock = threading.Lock()
        self._published = 0
        self._failed = 0

    def publish(self, decision: Decision) -> bool:
        """Queue one decision for the topic; False if the producer refused it."""
        try:
            future = self._sink.decision(decision)
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
        """Decisions acknowledged and failed."""
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
