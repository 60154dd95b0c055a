"""The synchronous Kafka clients (kafka-python) the product builds: every producer and consumer
made from a `KafkaConfig`, with its security, batching and fetch settings, comes from here."""

from __future__ import annotations

from typing import Any

from .config import KafkaConfig

__all__ = ["kafka_consumer", "kafka_producer"]


def kafka_producer(config: KafkaConfig, **overrides: Any) -> Any:
    """A kafka-python producer with ``config``'s producer settings, ``overrides`` on top."""
    from kafka import KafkaProducer  # imported here: in-process users need no Kafka client

    return KafkaProducer(**{**config.producer_settings(), **overrides})


def kafka_consumer(config: KafkaConfig, **overrides: Any) -> Any:
    """A kafka-python consumer with ``config``'s connection and security settings, ``overrides`` on top."""
    from kafka import KafkaConsumer

    return KafkaConsumer(**{**config.client_settings(), **overrides})
