"""The synchronous Kafka clients (kafka-python) the product builds: every producer and consumer
made from a `KafkaConfig`, with its security, batching and fetch settings, comes from here."""

from __future__ import annotations

import socket
import time
from typing import Any

from .config import BrokerUnavailable, KafkaConfig

__all__ = ["kafka_consumer", "kafka_producer", "probe_bootstrap"]


def kafka_producer(config: KafkaConfig, **overrides: Any) -> Any:
    """A kafka-python producer with ``config``'s producer settings, ``overrides`` on top."""
    from kafka import KafkaProducer  # imported here: in-process users need no Kafka client

    return KafkaProducer(**{**config.producer_settings(), **overrides})


def kafka_consumer(config: KafkaConfig, **overrides: Any) -> Any:
    """A kafka-python consumer with ``config``'s connection and security settings, ``overrides`` on top."""
    from kafka import KafkaConsumer

    return KafkaConsumer(**{**config.client_settings(), **overrides})


def probe_bootstrap(bootstrap_servers: str, timeout_s: float) -> None:
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
