"""The topics the product runs on: default names, settings of the compacted ones, their creation."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CHECKPOINT_TOPIC_CONFIG", "DEADLETTER_TOPIC", "DECISIONS_TOPIC",
           "DECISIONS_TOPIC_CONFIG", "PARTIALS_TOPIC", "TELEMETRY_TOPIC", "PartitionCounts",
           "TopicError", "TopicPlan", "prepare_topics"]

logger = logging.getLogger(__name__)

_DEFAULT_PARTITIONS = 4
_DEFAULT_CONNECT_TIMEOUT_MS = 10_000

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


class TopicError(RuntimeError):
    """The topics exist in a shape the topology cannot run on."""


@dataclass(frozen=True)
class TopicPlan:
    """The topics one stream app runs on, and how to reach them; ``checkpoints`` (stage 1, stage 2)
    get one partition per partition of telemetry and partials."""

    bootstrap: str
    telemetry: tuple[str, ...]
    partials: str
    decisions: str
    deadletter: str
    checkpoints: tuple[str, str]
    replication_factor: int = 1
    security: Mapping[str, Any] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class PartitionCounts:
    """What the topology runs on: partitions of the telemetry topics and of the partials topic."""

    telemetry: int
    partials: int


async def prepare_topics(plan: TopicPlan, default_partitions: int = _DEFAULT_PARTITIONS) -> PartitionCounts:
    """Reach the cluster, create missing topics, and return the partition counts. Raises
    `BrokerUnavailable` when no broker answers, `TopicError` when telemetry topics disagree on their
    partition count or a checkpoint topic does not follow its input."""
    from aiokafka.errors import KafkaConnectionError, KafkaError

    from .clients import aiokafka_admin
    from .config import BrokerUnavailable

    admin = aiokafka_admin(plan.bootstrap, security=plan.security, request_timeout_ms=_DEFAULT_CONNECT_TIMEOUT_MS)
    try:
        client_log = logging.getLogger("aiokafka")
        level = client_log.level
        client_log.setLevel(logging.CRITICAL)  # the error below says it once, with the address
        try:
            await admin.start()
        except (KafkaConnectionError, KafkaError, OSError) as error:
            raise BrokerUnavailable(f"cannot reach Kafka at {plan.bootstrap}: {error}") from error
        finally:
            client_log.setLevel(level)
        try:
            return await _ensure_topics(admin, plan, default_partitions)
        except KafkaError as error:
            raise TopicError(f"cannot inspect or create the topics on {plan.bootstrap}: {error}") from error
    finally:
        await admin.close()


async def _ensure_topics(admin: Any, plan: TopicPlan, default_partitions: int) -> PartitionCounts:
    """Create what is missing; the partition counts the topology runs on."""
    from aiokafka.admin import NewTopic

    existing = await _partition_counts(admin, [*plan.telemetry, plan.partials, plan.decisions, plan.deadletter])
    telemetry = {t: existing.get(t) for t in plan.telemetry}
    counts = {n for n in telemetry.values() if n}
    if len(counts) > 1:
        raise TopicError(f"telemetry topics must have the same number of partitions, got {telemetry}")
    telemetry_partitions = counts.pop() if counts else default_partitions
    replication = plan.replication_factor
    wanted = [NewTopic(t, telemetry_partitions, replication) for t, n in telemetry.items() if not n]
    for name in (plan.partials, plan.deadletter):
        if not existing.get(name):
            wanted.append(NewTopic(name, telemetry_partitions, replication))
    if not existing.get(plan.decisions):
        wanted.append(NewTopic(plan.decisions, 1, replication, topic_configs=dict(DECISIONS_TOPIC_CONFIG)))
    if wanted:
        logger.info("creating topics %s", ", ".join(t.name for t in wanted))
        await admin.create_topics(wanted)
        existing = await _partition_counts(admin, [plan.partials])
    partials_partitions = existing[plan.partials]
    follows = dict(zip(plan.checkpoints, (telemetry_partitions, partials_partitions)))
    present = await _partition_counts(admin, list(follows))
    for name, partitions in follows.items():
        if name in present and present[name] != partitions:
            raise TopicError(f"checkpoint topic {name} has {present[name]} partitions, the topic it "
                             f"follows has {partitions}: delete it, or use another --app-id")
    missing = [NewTopic(name, partitions, replication, topic_configs=dict(CHECKPOINT_TOPIC_CONFIG))
               for name, partitions in follows.items() if name not in present]
    if missing:
        await admin.create_topics(missing)
    return PartitionCounts(telemetry_partitions, partials_partitions)


async def _partition_counts(admin: Any, names: list[str]) -> dict[str, int]:
    present = set(await admin.list_topics())
    wanted = [n for n in names if n in present]
    described = await admin.describe_topics(wanted) if wanted else []
    return {d["topic"]: len(d["partitions"]) for d in described if not d.get("error_code")}
