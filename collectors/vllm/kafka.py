"""Ready-made factories that connect the vLLM collector to Kafka, for `vllm serve` deployments.

Named by ``SPECWATCH_VLLM_SINK`` and ``SPECWATCH_VLLM_FLAGS``; settings in docs/DEPLOY.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from specwatch.transport.topics import DECISIONS_TOPIC

__all__ = ["decision_flags", "telemetry_sink"]


def telemetry_sink(environ: Mapping[str, str] | None = None) -> Any:
    """A `TelemetryEmitter` exporting to the telemetry topic, with the on-disk spool; its ``emit`` never blocks."""
    from .sink import telemetry_sink

    return telemetry_sink(environ, exporter="kafka")


def decision_flags(environ: Mapping[str, str] | None = None) -> Any:
    """A started `FlagClient` on the decisions topic; the collector asks it per step."""
    from specwatch.collectors.flag_client import FlagClient
    from specwatch.transport.signing import Keyring
    from specwatch.transport.config import KafkaConfig

    environ = os.environ if environ is None else environ
    topic = environ.get("SPECWATCH_DECISIONS_TOPIC") or DECISIONS_TOPIC
    silence = environ.get("SPECWATCH_SILENCE_SECONDS")
    try:  # unset: the client's default
        options = {"silence_seconds": float(silence)} if silence else {}
    except ValueError:
        raise ValueError(f"SPECWATCH_SILENCE_SECONDS must be a number of seconds, got {silence!r}") from None
    client = FlagClient(KafkaConfig.from_env(environ=environ, client_id="specwatch-vllm-flags"), topic=topic,
                        keyring=Keyring.from_env(environ),
                        fail_safe=environ.get("SPECWATCH_FAIL_SAFE") or "keep_last", **options)
    return client.start()
