"""Ready-made factories that connect the vLLM collector to Kafka, for `vllm serve` deployments.

Point the plugin's environment variables at them (see docs/DEPLOY.md)::

    SPECWATCH_VLLM_SINK=specwatch.collectors.vllm.kafka:telemetry_sink
    SPECWATCH_VLLM_FLAGS=specwatch.collectors.vllm.kafka:decision_flags
    SPECWATCH_KAFKA_BOOTSTRAP=kafka-1:9092,kafka-2:9092

The sink emits through the bounded OpenTelemetry emitter and the Kafka exporter (the
engine thread only queues), which spools to local disk while the broker is away
(``SPECWATCH_TELEMETRY_SPOOL_*``); `specwatch.collectors.vllm.sink` exports OTLP to a
Collector instead. The flags follow the decisions topic in a background thread,
checking signatures with the ``SPECWATCH_SIGNING_KEY[_FILE]`` settings. Settings:

- ``SPECWATCH_KAFKA_*``: the cluster and its security (`KafkaConfig.from_env`);
- ``SPECWATCH_TELEMETRY_TOPIC`` (default ``specwatch.telemetry``) and
  ``SPECWATCH_DECISIONS_TOPIC`` (default ``specwatch.decisions``);
- ``SPECWATCH_FAIL_SAFE``: ``keep_last`` (default) or ``standard_decoding``, what the
  flags answer while the decisions topic is silent;
- ``SPECWATCH_SILENCE_SECONDS`` (default 30): how long without heartbeats is silence.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from specwatch.transport.topics import DECISIONS_TOPIC

__all__ = ["decision_flags", "telemetry_sink"]

_DEFAULT_SILENCE_SECONDS = 30.0


def telemetry_sink(environ: Mapping[str, str] | None = None) -> Any:
    """A `TelemetryEmitter` exporting to the telemetry topic, with the on-disk spool; its ``emit`` never blocks."""
    from .sink import kafka_telemetry_sink

    return kafka_telemetry_sink(environ)


def decision_flags(environ: Mapping[str, str] | None = None) -> Any:
    """A started `FlagClient` on the decisions topic; the collector asks it per step."""
    from specwatch.collectors.flag_client import FlagClient
    from specwatch.transport.signing import Keyring
    from specwatch.transport.config import KafkaConfig

    environ = os.environ if environ is None else environ
    topic = environ.get("SPECWATCH_DECISIONS_TOPIC") or DECISIONS_TOPIC
    silence = environ.get("SPECWATCH_SILENCE_SECONDS")
    try:
        silence_seconds = float(silence) if silence else _DEFAULT_SILENCE_SECONDS
    except ValueError:
        raise ValueError(f"SPECWATCH_SILENCE_SECONDS must be a number of seconds, got {silence!r}") from None
    client = FlagClient(KafkaConfig.from_env(environ=environ, client_id="specwatch-vllm-flags"), topic=topic,
                        keyring=Keyring.from_env(environ), silence_seconds=silence_seconds,
                        fail_safe=environ.get("SPECWATCH_FAIL_SAFE") or "keep_last")
    return client.start()
