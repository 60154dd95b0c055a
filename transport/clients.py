"""Every Kafka client the product builds (kafka-python and aiokafka producers, consumers and admin
clients) comes from here, made from a `KafkaConfig` with its security, batching and fetch settings."""

from __future__ import annotations

import socket
import time
from typing import Any

from .config import BrokerUnavailable, KafkaConfig

__all__ = ["FROM_EARLIEST", "aiokafka_admin", "aiokafka_consumer", "kafka_admin", "kafka_consumer", "kafka_producer",
           "probe_bootstrap"]

# A reader of a whole topic that joins no group: it starts at the first offset and commits nothing.
FROM_EARLIEST: dict[str, Any] = {"group_id": None, "auto_offset_reset": "earliest", "enable_auto_commit": False}


def kafka_producer(config: KafkaConfig, **overrides: Any) -> Any:
    """A kafka-python producer with ``config``'s producer settings, ``overrides`` on top."""
    from kafka import KafkaProducer  # imported here: in-process users need no Kafka client

    return KafkaProducer(**{**config.producer_settings(), **overrides})


def kafka_consumer(config: KafkaConfig, *topics: str, **overrides: Any) -> Any:
    """A kafka-python consumer of ``topics`` (none: assigned later) with ``config``'s connection and
    security settings, ``overrides`` on top."""
    from kafka import KafkaConsumer

    return KafkaConsumer(*topics, **{**config.client_settings(), **overrides})


def kafka_admin(config: KafkaConfig, **overrides: Any) -> Any:
    """A kafka-python admin client with ``config``'s connection and security settings."""
    from kafka.admin import KafkaAdminClient

    return KafkaAdminClient(**{**config.client_settings(), **overrides})


def aiokafka_consumer(config: KafkaConfig, *topics: str, **overrides: Any) -> Any:
    """An aiokafka consumer of ``topics`` with ``config``'s security and fetch settings, ``overrides``
    on top; not started."""
    from aiokafka import AIOKafkaConsumer

    return AIOKafkaConsumer(*topics, **{"bootstrap_servers": config.bootstrap_servers.split(","),
                                        **config.aiokafka_security(), **config.aiokafka_fetch_settings(),
                                        **overrides})


def aiokafka_admin(config: KafkaConfig, **overrides: Any) -> Any:
    """An aiokafka admin client with ``config``'s security settings; not started."""
    from aiokafka.admin import AIOKafkaAdminClient

    return AIOKafkaAdminClient(**{"bootstrap_servers": config.bootstrap_servers.split(","),
                                  **config.aiokafka_security(), **overrides})


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
