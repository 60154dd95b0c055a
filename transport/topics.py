"""The topics the product runs on: default names and the settings of the compacted ones, written once."""

from __future__ import annotations

__all__ = [
    "CHECKPOINT_TOPIC_CONFIG",
    "DEADLETTER_TOPIC",
    "DECISIONS_TOPIC",
    "DECISIONS_TOPIC_CONFIG",
    "PARTIALS_TOPIC",
    "TELEMETRY_TOPIC",
]

TELEMETRY_TOPIC = "specwatch.telemetry"
"""Contract-v1 telemetry as OTLP logs, keyed by engine worker."""
PARTIALS_TOPIC = "specwatch.partials"
"""Stage 1 -> stage 2 slice batches, routed by bundle."""
DECISIONS_TOPIC = "specwatch.decisions"
"""Signed decisions and heartbeats, compacted: one live value per scope and publisher."""
DEADLETTER_TOPIC = "specwatch.deadletter"
"""Rejected telemetry records, with the reason and where they came from."""

DECISIONS_TOPIC_CONFIG = {"cleanup.policy": "compact", "min.cleanable.dirty.ratio": "0.1", "segment.ms": "600000"}
# Checkpoint topics keep one live value per key; small segments let compaction drop
# superseded checkpoints soon, so a restart reads little.
CHECKPOINT_TOPIC_CONFIG = {"cleanup.policy": "compact", "segment.bytes": str(16 << 20),
                           "min.cleanable.dirty.ratio": "0.1", "max.message.bytes": str(2 << 20)}
