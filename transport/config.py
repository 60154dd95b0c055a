"""How to reach the Kafka cluster: one validated config, its security settings per client
library."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .topics import TELEMETRY_TOPIC

__all__ = ["BrokerUnavailable", "KafkaConfig"]


class BrokerUnavailable(ConnectionError):
    """Kafka could not be reached, or did not answer, within the connect timeout."""


# SPECWATCH_KAFKA_<NAME> sets the field of that name (the whole numbers: client tuning); the
# SASL password may also come from a file.
_KAFKA_ENV = ("security_protocol", "sasl_mechanism", "sasl_username", "sasl_password", "ssl_cafile",
              "ssl_certfile", "ssl_keyfile", "linger_ms", "batch_size", "fetch_max_bytes",
              "max_partition_fetch_bytes", "max_poll_records")
# kafka-python needs the broker version up front or it connects while being constructed.
_DEFAULT_API_VERSION = (4, 0)
_DEFAULT_LINGER_MS = 20
_DEFAULT_BATCH_BYTES = 512 * 1024
_DEFAULT_MAX_REQUEST_BYTES = 1024 * 1024
# How long a send may wait for metadata or buffer space. It runs on the export thread,
# never the engine's; while it waits, the queue absorbs records and then drops them.
_DEFAULT_MAX_BLOCK_MS = 2_000
_DEFAULT_REQUEST_TIMEOUT_MS = 10_000
_DEFAULT_DELIVERY_TIMEOUT_MS = 30_000
# Consumers (the stream workers): what one fetch may bring, per partition and in all, and
# how many messages one poll hands over.
_DEFAULT_FETCH_MAX_BYTES = 50 * 1024 * 1024
_DEFAULT_MAX_PARTITION_FETCH_BYTES = 1024 * 1024
_DEFAULT_MAX_POLL_RECORDS = 500
_COMPRESSIONS = ("none", "gzip", "lz4", "zstd")  # snappy: no codec installed for kafka-python
_SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
_SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER", "GSSAPI")


@dataclass(frozen=True)
class KafkaConfig:
    """How to reach a Kafka cluster; validated once, secrets kept out of repr and logs (``extra``
    goes to kafka-python producers as is).

    >>> KafkaConfig("127.0.0.1:19092", compression_type="zstd").producer_settings()["compression_type"]
    'zstd'
    >>> secured = KafkaConfig("k:9093", security_protocol="SASL_SSL", sasl_mechanism="PLAIN",
    ...                       sasl_username="svc", sasl_password="hunter2")
    >>> "hunter2" in repr(secured), secured.producer_settings()["sasl_plain_password"]
    (False, 'hunter2')
    >>> KafkaConfig("k:9092", acks=2)
    Traceback (most recent call last):
    ...
    ValueError: acks must be 0, 1 or 'all', got 2
    """

    bootstrap_servers: str
    topic: str = TELEMETRY_TOPIC
    client_id: str = "specwatch"
    acks: int | str = "all"
    linger_ms: int = _DEFAULT_LINGER_MS
    batch_size: int = _DEFAULT_BATCH_BYTES
    compression_type: str = "lz4"
    max_request_size: int = _DEFAULT_MAX_REQUEST_BYTES
    max_block_ms: int = _DEFAULT_MAX_BLOCK_MS
    request_timeout_ms: int = _DEFAULT_REQUEST_TIMEOUT_MS
    delivery_timeout_ms: int = _DEFAULT_DELIVERY_TIMEOUT_MS
    fetch_max_bytes: int = _DEFAULT_FETCH_MAX_BYTES
    max_partition_fetch_bytes: int = _DEFAULT_MAX_PARTITION_FETCH_BYTES
    max_poll_records: int = _DEFAULT_MAX_POLL_RECORDS
    api_version: tuple[int, ...] = _DEFAULT_API_VERSION
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: str | None = field(default=None, repr=False)
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_password: str | None = field(default=None, repr=False)
    ssl_check_hostname: bool = True
    extra: Mapping[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not self.bootstrap_servers or not all(":" in s for s in self.bootstrap_servers.split(",")):
            raise ValueError(f"bootstrap_servers must be HOST:PORT[,HOST:PORT...], got {self.bootstrap_servers!r}")
        if self.acks not in (0, 1, -1, "all", "0", "1"):
            raise ValueError(f"acks must be 0, 1 or 'all', got {self.acks!r}")
        if self.compression_type not in _COMPRESSIONS:
            raise ValueError(f"compression_type must be one of {', '.join(_COMPRESSIONS)}, "
                             f"got {self.compression_type!r}")
        if self.security_protocol not in _SECURITY_PROTOCOLS:
            raise ValueError(f"security_protocol must be one of {', '.join(_SECURITY_PROTOCOLS)}, "
                             f"got {self.security_protocol!r}")
        if self.security_protocol.startswith("SASL_"):
            if self.sasl_mechanism not in _SASL_MECHANISMS:
                raise ValueError(f"{self.security_protocol} needs sasl_mechanism, one of "
                                 f"{', '.join(_SASL_MECHANISMS)}; got {self.sasl_mechanism!r}")
            if self.sasl_mechanism in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512") and not (
                    self.sasl_username and self.sasl_password):
                raise ValueError(f"sasl_mechanism {self.sasl_mechanism} needs sasl_username and sasl_password")
        for name in ("linger_ms", "max_block_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("batch_size", "max_request_size", "request_timeout_ms", "delivery_timeout_ms",
                     "fetch_max_bytes", "max_partition_fetch_bytes", "max_poll_records"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @classmethod
    def from_env(cls, bootstrap: str | None = None, environ: Mapping[str, str] | None = None,
                 **settings: Any) -> "KafkaConfig":
        """A config from ``SPECWATCH_KAFKA_*`` (docs/DEPLOY.md); ``bootstrap`` and ``settings`` win.

        >>> env = {"SPECWATCH_KAFKA_BOOTSTRAP": "k:9093", "SPECWATCH_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        ...        "SPECWATCH_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512", "SPECWATCH_KAFKA_SASL_USERNAME": "svc",
        ...        "SPECWATCH_KAFKA_SASL_PASSWORD": "hunter2"}
        >>> config = KafkaConfig.from_env(environ=env, topic="t")
        >>> config.bootstrap_servers, config.sasl_mechanism, config.topic, "hunter2" in repr(config)
        ('k:9093', 'SCRAM-SHA-512', 't', False)
        >>> KafkaConfig.from_env(environ={"SPECWATCH_KAFKA_BOOTSTRAP": "k:1", "SPECWATCH_KAFKA_MAX_POLL_RECORDS": "1"}).max_poll_records
        1
        >>> KafkaConfig.from_env(environ={"SPECWATCH_KAFKA_BOOTSTRAP": "k:1", "SPECWATCH_KAFKA_LINGER_MS": "soon"})
        Traceback (most recent call last):
        ...
        ValueError: SPECWATCH_KAFKA_LINGER_MS must be a whole number, got 'soon'
        """
        environ = os.environ if environ is None else environ
        found: dict[str, Any] = {}
        whole = {f.name for f in fields(cls) if f.type == "int"}
        names = {"BOOTSTRAP": "bootstrap_servers", "COMPRESSION": "compression_type",
                 **{name.upper(): name for name in _KAFKA_ENV}}
        for name, field_name in names.items():
            value = environ.get(f"SPECWATCH_KAFKA_{name}")
            try:
                if value:
                    found[field_name] = int(value) if field_name in whole else value
            except ValueError:
                raise ValueError(f"SPECWATCH_KAFKA_{name} must be a whole number, got {value!r}") from None
        password_file = environ.get("SPECWATCH_KAFKA_SASL_PASSWORD_FILE")
        if password_file:
            if "sasl_password" in found:
                raise ValueError("set either SPECWATCH_KAFKA_SASL_PASSWORD or SPECWATCH_KAFKA_SASL_PASSWORD_FILE, "
                                 "not both")
            try:
                found["sasl_password"] = Path(password_file).read_text().rstrip("\r\n")
            except OSError as error:
                raise ValueError(f"cannot read SPECWATCH_KAFKA_SASL_PASSWORD_FILE ({password_file}): "
                                 f"{error.strerror or error}") from None
        if bootstrap:
            found["bootstrap_servers"] = bootstrap
        if "bootstrap_servers" not in found:
            raise ValueError("no Kafka bootstrap servers: pass them or set SPECWATCH_KAFKA_BOOTSTRAP")
        found.update(settings)
        return cls(**found)

    def client_settings(self) -> dict[str, Any]:
        """Connection and security settings shared by kafka-python producers, consumers and admin clients."""
        settings: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap_servers.split(","),
            "client_id": self.client_id,
            "api_version": tuple(self.api_version),
            "request_timeout_ms": self.request_timeout_ms,
            "security_protocol": self.security_protocol,
            **self._sasl_settings(),
        }
        if self._uses_tls():
            settings.update(ssl_cafile=self.ssl_cafile, ssl_certfile=self.ssl_certfile,
                            ssl_keyfile=self.ssl_keyfile, ssl_password=self.ssl_password,
                            ssl_check_hostname=self.ssl_check_hostname)
        return settings

    def aiokafka_security(self) -> dict[str, Any]:
        """The same security settings for aiokafka clients (TLS as an SSL context); {} for PLAINTEXT.

        >>> KafkaConfig("k:9092").aiokafka_security()
        {}
        >>> options = KafkaConfig("k:9093", security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN",
        ...                       sasl_username="svc", sasl_password="pw").aiokafka_security()
        >>> options["security_protocol"], options["sasl_mechanism"], options["sasl_plain_username"]
        ('SASL_PLAINTEXT', 'PLAIN', 'svc')
        """
        if self.security_protocol == "PLAINTEXT":
            return {}
        options: dict[str, Any] = {"security_protocol": self.security_protocol, **self._sasl_settings()}
        if self._uses_tls():
            options["ssl_context"] = self._ssl_context()
        return options

    def faust_credentials(self) -> Any:
        """The same security settings as Faust broker credentials (None for PLAINTEXT).

        >>> KafkaConfig("k:9092").faust_credentials() is None
        True
        >>> KafkaConfig("k:9093", security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN",
        ...             sasl_username="svc", sasl_password="pw").faust_credentials().username
        'svc'
        """
        if self.security_protocol == "PLAINTEXT":
            return None
        import faust  # the worker's dependency; engines never get here

        if self.security_protocol == "SSL":
            return faust.SSLCredentials(self._ssl_context())
        return faust.SASLCredentials(username=self.sasl_username, password=self.sasl_password,
                                     mechanism=self.sasl_mechanism,
                                     ssl_context=self._ssl_context() if self._uses_tls() else None)

    def _uses_tls(self) -> bool:
        return self.security_protocol in ("SSL", "SASL_SSL")

    def _sasl_settings(self) -> dict[str, Any]:
        if not self.security_protocol.startswith("SASL_"):
            return {}
        return {"sasl_mechanism": self.sasl_mechanism, "sasl_plain_username": self.sasl_username,
                "sasl_plain_password": self.sasl_password}

    def _ssl_context(self) -> Any:
        from aiokafka.helpers import create_ssl_context

        context = create_ssl_context(cafile=self.ssl_cafile, certfile=self.ssl_certfile,
                                     keyfile=self.ssl_keyfile, password=self.ssl_password)
        context.check_hostname = self.ssl_check_hostname
        return context

    def _producer_common(self) -> dict[str, Any]:
        """The producer settings both client libraries name alike."""
        acks = "all" if self.acks in (-1, "all") else int(self.acks)
        compression = None if self.compression_type == "none" else self.compression_type
        # Idempotence keeps per-key order through retries; it needs acks=all.
        return {"acks": acks, "enable_idempotence": acks == "all", "linger_ms": self.linger_ms,
                "compression_type": compression, "max_request_size": self.max_request_size}

    def aiokafka_producer_settings(self, **overrides: Any) -> dict[str, Any]:
        """The producer settings of `producer_settings` in aiokafka's names, with its security options.

        >>> options = KafkaConfig("k:9092").aiokafka_producer_settings(linger_ms=1)
        >>> options["compression_type"], options["linger_ms"], options["max_batch_size"] == KafkaConfig("k:9092").batch_size
        ('lz4', 1, True)
        """
        return {"bootstrap_servers": self.bootstrap_servers.split(","), "client_id": self.client_id,
                "request_timeout_ms": self.request_timeout_ms, **self._producer_common(),
                "max_batch_size": self.batch_size, **self.aiokafka_security(), **overrides}

    def aiokafka_fetch_settings(self) -> dict[str, Any]:
        """What one fetch of an aiokafka consumer may bring, per partition and in all."""
        return {"fetch_max_bytes": self.fetch_max_bytes, "max_partition_fetch_bytes": self.max_partition_fetch_bytes}

    def faust_consumer_settings(self) -> dict[str, Any]:
        """The consumer's fetch settings as Faust app settings (Faust's consumer is aiokafka's).
        Faust offers no total fetch limit: ``fetch_max_bytes`` stays aiokafka's 50 MiB there."""
        return {"consumer_max_fetch_size": self.max_partition_fetch_bytes,
                "broker_max_poll_records": self.max_poll_records}

    def producer_settings(self) -> dict[str, Any]:
        delivery_timeout = max(self.delivery_timeout_ms, self.request_timeout_ms + self.linger_ms)
        return {**self.client_settings(), **self._producer_common(), "batch_size": self.batch_size,
                "max_block_ms": self.max_block_ms, "delivery_timeout_ms": delivery_timeout,
                **self.extra}
