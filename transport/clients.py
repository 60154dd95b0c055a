"""Every Kafka client the product builds (kafka-python and aiokafka producers, consumers and admin
clients) comes from here, made from a `KafkaConfig` with its security, batching and fetch settings."""

from __future__ import annotations

import socket
import time
from collections.abc import Mapping
from typing import Any

from .config import BrokerUnavailable, KafkaConfig

__all__ = ["FROM_EARLIEST", "aiokafka_admin", "aiokafka_consumer", "aiokafka_producer", "kafka_admin",
           "kafka_consumer", "kafka_producer", "probe_bootstrap"]

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


def aiokafka_consumer(kafka: KafkaConfig | str, *topics: str, security: Mapping[str, Any] | None = None,
                      fetch: Mapping[str, Any] | None = None, **overrides: Any) -> Any:
    """An aiokafka consumer of ``topics``, not started. ``kafka`` is a `KafkaConfig` (its bootstrap
    servers, security and fetch settings) or the bootstrap servers alone, with ``security``
    (`KafkaConfig.aiokafka_security`) and ``fetch`` (`KafkaConfig.aiokafka_fetch_settings`) given;
    ``overrides`` on top."""
    from aiokafka import AIOKafkaConsumer

    bootstrap, security, fetch = _reach(kafka, security, fetch)
    return AIOKafkaConsumer(*topics, **{"bootstrap_servers": bootstrap, **security, **fetch, **overrides})


def aiokafka_producer(settings: Mapping[str, Any]) -> Any:
    """An aiokafka producer with ``settings`` (`KafkaConfig.aiokafka_producer_settings`); not started."""
    from aiokafka import AIOKafkaProducer

    return AIOKafkaProducer(**settings)


def aiokafka_admin(kafka: KafkaConfig | str, *, security: Mapping[str, Any] | None = None,
                   **overrides: Any) -> Any:
    """An aiokafka admin client, not started: ``kafka`` as for `aiokafka_consumer`."""
    from aiokafka.admin import AIOKafkaAdminClient

    bootstrap, security, _ = _reach(kafka, security, {})
    return AIOKafkaAdminClient(**{"bootstrap_servers": bootstrap, **security, **overrides})


def _reach(kafka: KafkaConfig | str, security: Mapping[str, Any] | None,
           fetch: Mapping[str, Any] | None) -> tuple[list[str], dict[str, Any], dict[str, Any]]:
    """Bootstrap servers, security and fetch settings: given, or a `KafkaConfig`'s own.

    >>> _reach("k1:9092,k2:9092", None, {"fetch_max_bytes": 1 << 20})
    (['k1:9092', 'k2:9092'], {}, {'fetch_max_bytes': 1048576})
    >>> _reach(KafkaConfig("k:9092"), None, None)[2] == KafkaConfig("k:9092").aiokafka_fetch_settings()
    True
    """
    if isinstance(kafka, KafkaConfig):
        security = kafka.aiokafka_security() if security is None else security
        fetch = kafka.aiokafka_fetch_settings() if fetch is None else fetch
        kafka = kafka.bootstrap_servers
    return kafka.split(","), dict(security or {}), dict(fetch or {})


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
