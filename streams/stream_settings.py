"""The stream worker's settings: validated once, before Faust starts, and the environment
switches `specwatch run` reads into them."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Mapping

from specwatch.archive.dsn import ArchiveDsn
from specwatch.schemas import Policy
from specwatch.transport.config import KafkaConfig
from specwatch.transport.topics import (
    DEADLETTER_TOPIC,
    DECISIONS_TOPIC,
    PARTIALS_TOPIC,
    TELEMETRY_TOPIC,
    PartitionCounts,
    TopicPlan,
)

from .operations import OperationsSettings

__all__ = ["CHECKPOINT_BEFORE_PUBLISH_ENV", "SEND_PARTIALS_ENV", "StreamSettings", "checkpoint_before_publish_setting",
           "send_partials_setting"]

SEND_PARTIALS_ENV = "SPECWATCH_SEND_PARTIALS_AFTER_MS"
CHECKPOINT_BEFORE_PUBLISH_ENV = "SPECWATCH_CHECKPOINT_BEFORE_PUBLISH"
_DEFAULT_APP_ID = "specwatch"
_DEFAULT_CHECKPOINT_SECONDS = 2.0
_DEFAULT_SOURCE_SILENCE_SECONDS = 10.0
_DEFAULT_SESSION_TIMEOUT_SECONDS = 30.0


@dataclass(frozen=True)
class StreamSettings:
    """Everything a worker needs; validated once, before Faust starts."""

    bootstrap: str
    telemetry_topics: tuple[str, ...] = (TELEMETRY_TOPIC,)
    partials_topic: str = PARTIALS_TOPIC
    decisions_topic: str = DECISIONS_TOPIC
    deadletter_topic: str = DEADLETTER_TOPIC
    app_id: str = _DEFAULT_APP_ID
    policy: Policy = field(default_factory=Policy)
    archive_dsn: ArchiveDsn | str | None = None  # parsed where the command line checked it
    data_dir: str = "specwatch-data/faust/worker-0"
    telemetry_partitions: int = 0
    partials_partitions: int = 0
    checkpoint_seconds: float = _DEFAULT_CHECKPOINT_SECONDS
    source_silence_seconds: float = _DEFAULT_SOURCE_SILENCE_SECONDS
    session_timeout_seconds: float = _DEFAULT_SESSION_TIMEOUT_SECONDS
    replication_factor: int = 1
    kafka: KafkaConfig | None = field(default=None, repr=False)
    operations: OperationsSettings = field(default_factory=OperationsSettings)
    # Stage 1 sends the slices a fetch has closed (and lets stage 2 and the producer run) once
    # it has folded this long; None: once at the end of the fetch (`send_partials_setting`).
    partials_after_seconds: float | None = None
    # A file each worker appends one JSON line to per decision: where its time went (`DecisionTrace`).
    decision_trace: str | None = None
    # Stage 2 saves the task (decisions in its outbox) before publishing each decision, as
    # earlier versions did; off, decisions go out first and a restart's refold plus the ids on
    # the decisions topic keep them exactly once (`Stage2Runner`). Kept to measure the two.
    checkpoint_before_publish: bool = False

    def __post_init__(self) -> None:
        if not self.bootstrap or not all(":" in s for s in self.bootstrap.split(",")):
            raise ValueError(f"bootstrap must be HOST:PORT[,HOST:PORT...], got {self.bootstrap!r}")
        if not self.telemetry_topics:
            raise ValueError("at least one telemetry topic is needed")
        names = [*self.telemetry_topics, self.partials_topic, self.decisions_topic, self.deadletter_topic]
        if len(set(names)) != len(names):
            raise ValueError(f"telemetry, partials, decisions and dead-letter topics must differ, got {names}")
        if not self.checkpoint_seconds > 0:
            raise ValueError(f"checkpoint_seconds must be > 0, got {self.checkpoint_seconds}")
        if not self.source_silence_seconds > 0:
            raise ValueError(f"source_silence_seconds must be > 0, got {self.source_silence_seconds}")
        if not self.session_timeout_seconds >= 6:
            raise ValueError("session_timeout_seconds must be >= 6 (the broker's minimum session), "
                             f"got {self.session_timeout_seconds}")
        if self.replication_factor < 1:
            raise ValueError(f"replication_factor must be >= 1, got {self.replication_factor}")
        if self.partials_after_seconds is not None and not self.partials_after_seconds >= 0:
            raise ValueError(f"partials_after_seconds must be >= 0 or None, got {self.partials_after_seconds}")

    @property
    def kafka_config(self) -> KafkaConfig:
        """The cluster's config: ``kafka``, or the defaults for ``bootstrap``."""
        return self.kafka if self.kafka is not None else KafkaConfig(self.bootstrap)

    def checkpoint_topic(self, stage: str) -> str:
        """The compacted topic holding the checkpoints of ``stage`` ("stage1" or "stage2")."""
        return f"{self.app_id}.{stage}-checkpoints"

    @property
    def sources(self) -> tuple[str, ...]:
        """Every telemetry partition, named as stage 2 knows it."""
        return tuple(f"{topic}/{p}" for topic in self.telemetry_topics for p in range(self.telemetry_partitions))

    def topic_plan(self) -> TopicPlan:
        """The topics this app runs on, for `specwatch.transport.topics.prepare_topics`."""
        return TopicPlan(self.bootstrap, self.telemetry_topics, self.partials_topic, self.decisions_topic,
                         self.deadletter_topic, (self.checkpoint_topic("stage1"), self.checkpoint_topic("stage2")),
                         self.replication_factor, self.kafka_config.aiokafka_security())

    def with_partitions(self, counts: PartitionCounts) -> "StreamSettings":
        """These settings with the partition counts `prepare_topics` found."""
        return replace(self, telemetry_partitions=counts.telemetry, partials_partitions=counts.partials)


def send_partials_setting(environ: Mapping[str, str] | None = None) -> float | None:
    """``SPECWATCH_SEND_PARTIALS_AFTER_MS``: stage 1 sends closed slices after folding that many
    milliseconds of a fetch (0: after every message that closed one); unset or empty, at the fetch's end.

    >>> send_partials_setting({"SPECWATCH_SEND_PARTIALS_AFTER_MS": "50"}), send_partials_setting({})
    (0.05, None)
    """
    value = (os.environ if environ is None else environ).get(SEND_PARTIALS_ENV)
    if not value:
        return None
    milliseconds = float(value) if value.replace(".", "", 1).isdigit() else -1.0
    if not milliseconds >= 0:
        raise ValueError(f"{SEND_PARTIALS_ENV} must be a number of milliseconds >= 0, got {value!r}")
    return milliseconds / 1000.0


def checkpoint_before_publish_setting(environ: Mapping[str, str] | None = None) -> bool:
    """``SPECWATCH_CHECKPOINT_BEFORE_PUBLISH``: 1 makes stage 2 checkpoint before each publish
    (the earlier behaviour, slower at load); 0, unset or empty publishes first.

    >>> checkpoint_before_publish_setting({CHECKPOINT_BEFORE_PUBLISH_ENV: "1"}), checkpoint_before_publish_setting({})
    (True, False)
    """
    value = (os.environ if environ is None else environ).get(CHECKPOINT_BEFORE_PUBLISH_ENV) or "0"
    if value not in ("0", "1"):
        raise ValueError(f"{CHECKPOINT_BEFORE_PUBLISH_ENV} must be 0 or 1, got {value!r}")
    return value == "1"
