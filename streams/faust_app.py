"""The Faust app: the processing topology on Kafka, the same stages the embedded pipeline runs."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass
from typing import Any

import faust
from faust.types import TP
from faust.types.tuples import Message as FaustMessage
from mode import CrashingSupervisor

from specwatch.actions.sinks.alertmanager import WEBHOOK_DETECTOR
from specwatch.transport.kafka_io import KafkaWriter, PartitionReader
from specwatch.transport.signing import Keyring

from .metrics import ServiceHealth
from .operations import Operations
from .checkpoint_log import CheckpointLog, convert_pickled_setting
from .partition_runner import Stage1Runner, Stage2Runner, StreamSettings

__all__ = ["StreamApp", "create_app", "run_worker"]

logger = logging.getLogger(__name__)

_RELEASE_CHECK_SECONDS = 1.0
# Flag clients count three missed heartbeats before they call the topic silent (30 s).
_HEARTBEAT_SECONDS = 10.0
_PROGRESS_LOG_SECONDS = 60.0
# An agent takes what the consumer fetched, up to a poll's records, and waits this long at
# most for more before it hands a short fetch to its runner.
_FETCH_WAIT_SECONDS = 0.05


def _acknowledge(app: faust.App, record: Any) -> None:
    """Mark a message read outside the stream as done in Faust's consumer."""
    app.consumer.ack(FaustMessage(record.topic, record.partition, record.offset, record.timestamp / 1000.0,
                                  record.timestamp_type, None, None, None, None,
                                  tp=TP(record.topic, record.partition)))


@dataclass(frozen=True)
class StreamApp:
    """A Faust app with the runners its agents call."""

    app: faust.App
    stage1: Stage1Runner
    stage2: Stage2Runner
    operations: Operations


def _faust_app(settings: StreamSettings, fetch: dict) -> faust.App:
    """The bare Faust app of ``settings``: broker, consumer ``fetch`` settings, web port, supervision."""
    kafka = settings.kafka_config
    return faust.App(
        settings.app_id,
        broker=[f"kafka://{server}" for server in settings.bootstrap.split(",")],
        broker_credentials=kafka.faust_credentials(),
        **fetch,
        store="memory://",
        datadir=settings.data_dir,
        web_enabled=settings.operations.web_port is not None,
        web_port=settings.operations.web_port or 6066,
        web_bind=settings.operations.web_bind,
        autodiscover=False,
        topic_replication_factor=settings.replication_factor,
        topic_partitions=settings.partials_partitions,
        topic_disable_leader=False,
        broker_session_timeout=settings.session_timeout_seconds,
        broker_heartbeat_interval=max(1.0, settings.session_timeout_seconds / 10),
        consumer_auto_offset_reset="earliest",
        processing_guarantee="at_least_once",
        # An agent that fails stops the worker (and the exit code says so) instead of
        # restarting in a loop; whoever runs the workers restarts it from its checkpoint.
        agent_supervisor=CrashingSupervisor,
    )


def create_app(settings: StreamSettings) -> StreamApp:
    """The Faust app for ``settings`` (counts from `prepare_topics`): topics, agents, timers."""
    if settings.telemetry_partitions < 1 or settings.partials_partitions < 1:
        raise ValueError("partition counts are unknown: pass the settings through prepare_topics() first")
    kafka = settings.kafka_config
    fetch = kafka.faust_consumer_settings()
    app = _faust_app(settings, fetch)

    raw = {"key_type": bytes, "value_type": bytes, "key_serializer": "raw", "value_serializer": "raw"}
    telemetry = app.topic(*settings.telemetry_topics, **raw)
    partials = app.topic(settings.partials_topic, partitions=settings.partials_partitions, **raw)

    writer = KafkaWriter(kafka)
    reader = PartitionReader(settings.bootstrap, kafka.aiokafka_security(),
                             fetch=kafka.aiokafka_fetch_settings())

    def assignment() -> set[tuple[str, int]]:
        return {(tp.topic, tp.partition) for tp in app.consumer.assignment()}

    wiring = {"assignment": assignment, "acknowledge": lambda message: _acknowledge(app, message)}
    # One keyring signs decisions and checkpoints: whoever may not forge the one may not forge the other.
    keyring, convert_pickled = Keyring.from_env(), convert_pickled_setting()

    def checkpoints(stage: str) -> CheckpointLog:
        return CheckpointLog(settings.checkpoint_topic(stage), writer, reader, keyring, convert_pickled)

    stage1 = Stage1Runner(settings, writer, reader, checkpoints("stage1"), **wiring)
    stage2 = Stage2Runner(settings, writer, reader, checkpoints("stage2"), keyring=keyring, **wiring)

    # Each runner takes a whole fetch at once: stage 1 folds it in one go and sends one
    # partials message per stage-2 partition for it.
    take = fetch["broker_max_poll_records"]

    @app.agent(telemetry, name="combine")
    async def combine(stream):
        async for events in stream.take_events(take, within=_FETCH_WAIT_SECONDS):
            await stage1.handle([event.message for event in events])

    @app.agent(partials, name="decide")
    async def decide(stream):
        async for events in stream.take_events(take, within=_FETCH_WAIT_SECONDS):
            await stage2.handle([event.message for event in events])

    @app.timer(interval=_RELEASE_CHECK_SECONDS)
    async def release_idle_sources():
        await stage1.catch_up()
        await stage2.catch_up()
        await stage1.release_idle_sources()

    @app.timer(interval=_HEARTBEAT_SECONDS)
    async def publish_heartbeats():
        await stage2.heartbeat()

    operations = Operations(settings.operations, lambda: _service_health(app, stage1, stage2), stages=stage2.stages)
    stage2.operations = operations
    if settings.operations.web_port is not None:
        operations.install(app, ready=lambda: _ready(app), cards=stage2.cards, publish=stage2.publish_decisions,
                           automatic=stage2.automatic, archive=stage2.archive_decisions)

    _log_progress(app, stage1, stage2)

    @app.on_partitions_revoked.connect
    async def on_revoked(app, revoked, **kwargs):
        stage1.forget(revoked)
        stage2.forget(revoked)

    @app.on_before_shutdown.connect
    async def on_shutdown(app, **kwargs):
        await writer.stop()

    return StreamApp(app, stage1, stage2, operations)


def _log_progress(app: faust.App, stage1: Stage1Runner, stage2: Stage2Runner) -> None:
    """A timer of ``app`` that logs one line per interval while work flows, nothing when idle."""
    logged, logged_at = (0, 0, 0), time.monotonic()

    @app.timer(interval=_PROGRESS_LOG_SECONDS)
    async def log_progress():
        nonlocal logged, logged_at
        now, current = time.monotonic(), (stage1.records, stage2.slices, stage2.decisions)
        if current != logged:
            records = current[0] - logged[0]
            logger.info("%d records folded (%.0f/s), %d slices decided, %d decisions, %d rejected",
                        records, records / max(now - logged_at, 1e-9), current[1] - logged[1],
                        current[2] - logged[2], stage1.rejected.total)
        logged, logged_at = current, now


def _ready(app: faust.App) -> bool:
    """Ready once the worker holds partitions and is not rebalancing."""
    return bool(app.consumer.assignment()) and not app.rebalancing


def _service_health(app: faust.App, stage1: Stage1Runner, stage2: Stage2Runner) -> ServiceHealth:
    now = time.time()
    def highwater(topic: str, partition: int) -> int | None:
        return app.consumer.highwater(TP(topic, partition))

    first = stage1.health(now, highwater)
    second = stage2.health(now, highwater)
    stage2.operations.view.engines_seen(stage1.engines_seen)
    return ServiceHealth(records_read=stage1.records, records_rejected=stage1.rejected.as_dict(),
                         consumer_lag={**first["lag"], **second["lag"]}, watermark_delay=first["delay"],
                         checkpoint_age={**first["age"], **second["age"]},
                         archive_spool_bytes=second["spool"], decisions_published=stage2.decisions,
                         decisions_outbox=second["outbox"], ready=_ready(app),
                         extra_counters={"specwatch_checkpoints_refused": (
                             "Stage-task checkpoints refused (the task rebuilt from its partition), by reason",
                             "reason", stage1.checkpoints.refused + stage2.checkpoints.refused)})


def _log_task_stacks() -> None:
    import io

    tasks = asyncio.all_tasks()
    out = io.StringIO()
    for task in sorted(tasks, key=lambda t: t.get_name()):
        task.print_stack(limit=12, file=out)
    logger.warning("%d asyncio tasks:\n%s", len(tasks), out.getvalue())


def _import_what_deciding_imports_late() -> None:
    """The detectors import scipy only when a decision needs it (the draft-length curve, the
    canary's tests): 1-3 s, more on a loaded machine, that the first decision of every worker
    paid after its evidence (the decision trace's ``decide_s``, docs/BENCHMARKS.md). A worker
    pays it at start instead; the embedded pipeline and one-shot commands keep the lazy import."""
    import scipy.optimize  # noqa: F401
    import scipy.stats  # noqa: F401


def run_worker(settings: StreamSettings, loglevel: str = "warning") -> int:
    """Run one Faust worker in this process until it is stopped (SIGTERM/SIGINT); returns the exit code."""
    stream = create_app(settings)
    stream.stage2.open_archive()  # before joining the group: an archive in use fails fast
    _import_what_deciding_imports_late()
    # the webhook's earlier rollbacks: a re-sent alert stays a duplicate across a restart
    stream.operations.remember(stream.stage2.archived_decisions(WEBHOOK_DETECTOR))
    worker = faust.Worker(stream.app, loglevel=loglevel, quiet=True, redirect_stdouts=False)
    worker.spinner = None  # a terminal progress spinner has no place in service logs

    @stream.app.task
    async def dump_tasks_on_sigusr1():
        # `kill -USR1 <pid>`: every asyncio task's stack to the log, to see what a quiet worker waits for
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, _log_task_stacks)

    stream.operations.start()
    try:
        worker.execute_from_commandline()
    except SystemExit as stop:
        return int(stop.code or 0)
    finally:
        stream.operations.stop()
        stream.stage2.close_archive()
    return 0
