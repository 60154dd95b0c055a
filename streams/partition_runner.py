"""The partition runner: one task per input partition, restored, fed in order, checkpointed."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Iterable

from specwatch.schemas import Rejection, RejectionCounter
from specwatch.transport.codec import DecisionSink
from specwatch.transport.kafka_io import acknowledged
from specwatch.transport.signing import Keyring

from .stage_tasks import (
    BundleOwner,
    Stage1Task,
    Stage2Task,
    dead_letter,
    decisions_in,
    decode_partial,
    encode_partials,
    encode_release,
    outbox_pending,
    route_batches,
)
from .checkpoint_log import CheckpointLog
from .decision_trace import DecisionTrace, timestamp_seconds
from .sources import IdleRule
from .operations import Operations
from .stream_settings import (
    CHECKPOINT_BEFORE_PUBLISH_ENV,
    SEND_PARTIALS_ENV,
    StreamSettings,
    checkpoint_before_publish_setting,
    send_partials_setting,
)

# The settings are re-exported: workers and tests take them from here with the runners.
__all__ = ["CHECKPOINT_BEFORE_PUBLISH_ENV", "SEND_PARTIALS_ENV", "PartitionRunner", "Stage1Runner", "Stage2Runner",
           "StreamSettings", "checkpoint_before_publish_setting", "send_partials_setting"]

logger = logging.getLogger(__name__)

# A partition assigned this long without delivering anything is restored and caught up by hand.
_CATCH_UP_AFTER_S = 3.0

TopicPartition = tuple[str, int]


def _overdue(assigned: set, tasks: Any, assigned_at: dict, now: float) -> list:
    """Assigned partitions without a task for `_CATCH_UP_AFTER_S` since first seen here, in order.

    >>> seen = {}
    >>> _overdue({1, 2}, {2: "task"}, seen, now=10.0), _overdue({1, 2}, {2: "task"}, seen, now=13.0)
    ([], [1])
    >>> _overdue({2}, {}, seen, now=14.0), sorted(seen)
    ([], [2])
    """
    for key in list(assigned_at):
        if key not in assigned:
            del assigned_at[key]
    return [key for key in sorted(assigned) if key not in tasks
            and now - assigned_at.setdefault(key, now) >= _CATCH_UP_AFTER_S]


class PartitionRunner:
    """One task per owned input partition, fed in offset order whatever the consumer delivers.

    A stage gives `inputs()` (the topics it folds), `new_task(tp)`, `fold(task, tp, messages)` (a
    fetch's consecutive messages, advancing the task's ``next_offset``), `taken_over(task, tp)`
    (restored or new, before it folds) and `before_checkpoint(task, tp)` (make true what the
    checkpoint claims: sent, archived).
    """

    stage = ""
    task_type: type = object

    def __init__(self, settings: StreamSettings, writer: Any, reader: Any, checkpoints: CheckpointLog, *,
                 assignment: Callable[[], Iterable[TopicPartition]],
                 acknowledge: Callable[[Any], None] = lambda message: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._writer = writer
        self._reader = reader
        self._checkpoints = checkpoints
        self._assignment = assignment
        self._acknowledge = acknowledge
        self._clock = clock
        self._tasks: dict[TopicPartition, Any] = {}
        self._lock = asyncio.Lock()  # the agent and the timers never work on a task at once
        self._assigned_at: dict[TopicPartition, float] = {}
        self._checkpointed_at: dict[TopicPartition, float] = {}
        self.skipped = 0

    @property
    def checkpoints(self) -> CheckpointLog:
        """Where this stage's tasks are saved and restored from (and the refusals it counted)."""
        return self._checkpoints

    def forgotten(self, tp: TopicPartition) -> None:
        """A partition was taken away."""

    def task_name(self, tp: TopicPartition) -> str:
        return f"{self.stage}/{tp[0]}/{tp[1]}"

    async def handle(self, messages: list) -> None:
        """What the consumer delivered in one fetch, in its order (each partition's in offset order)."""
        by_partition: dict[TopicPartition, list] = {}
        for message in messages:
            by_partition.setdefault((message.topic, message.partition), []).append(message)
        for tp, delivered in by_partition.items():
            async with self._lock:
                task = self._tasks.get(tp)
                if task is None:
                    task = await self._take_over(tp)
                run: list = []  # consecutive messages not folded yet
                for message in delivered:
                    expected = run[-1].offset + 1 if run else task.next_offset
                    if message.offset < expected:
                        self.skipped += 1  # folded before the restart
                        continue
                    if message.offset > expected:
                        if run:
                            await self.fold(task, tp, run)
                            run = []
                        await self._read_gap(task, tp, message.offset)
                    run.append(message)
                if run:
                    await self.fold(task, tp, run)
                if self._clock() - self._checkpointed_at.get(tp, 0.0) >= self.settings.checkpoint_seconds:
                    await self.checkpoint(task, tp)

    async def catch_up(self) -> None:
        """Owned partitions that delivered nothing since they were assigned: restore their
        tasks and fold what the checkpoints do not cover. The consumer delivers only what is
        past the group's commit, and a worker killed after committing but before its next
        checkpoint leaves that gap unread until a new message arrives, which it may never."""
        inputs = self.inputs()
        assigned = {(topic, partition) for topic, partition in self._assignment() if topic in inputs}
        waiting = _overdue(assigned, self._tasks, self._assigned_at, self._clock())
        ends: dict[str, dict[int, int]] = {}
        for tp in waiting:
            async with self._lock:
                if tp in self._tasks:
                    continue  # a message arrived meanwhile
                task = await self._take_over(tp)
                if tp[0] not in ends:
                    ends[tp[0]] = await self._reader.end_offsets(tp[0])
                end = ends[tp[0]].get(tp[1], 0)
                if end > task.next_offset:
                    await self._read_gap(task, tp, end)
                    await self.checkpoint(task, tp)

    def forget(self, tps: Iterable[TopicPartition]) -> None:
        """Partitions taken away: their next owner resumes from the checkpoint."""
        inputs = self.inputs()
        for topic, partition in tps:
            if topic in inputs:
                self._tasks.pop((topic, partition), None)
                self.forgotten((topic, partition))

    async def checkpoint(self, task: Any, tp: TopicPartition) -> None:
        await self.before_checkpoint(task, tp)
        await self._checkpoints.save(self.task_name(tp), tp[1], task)
        self._checkpointed_at[tp] = self._clock()

    async def _take_over(self, tp: TopicPartition) -> Any:
        name = self.task_name(tp)
        task = await self._checkpoints.load(name, tp[1])
        if isinstance(task, self.task_type):
            logger.info("%s resumes from its checkpoint at offset %d", name, task.next_offset)
            self._checkpointed_at[tp] = self._clock()
        else:
            # No checkpoint: the state is whatever the partition holds, from its first message,
            # wherever the group's committed offset points.
            task = self.new_task(tp)
            task.next_offset = await self._reader.beginning_offset(*tp)
        self._tasks[tp] = task
        await self.taken_over(task, tp)
        return task

    async def _read_gap(self, task: Any, tp: TopicPartition, upto: int) -> None:
        name = self.task_name(tp)
        logger.info("%s reads offsets %d..%d that its checkpoint does not cover", name, task.next_offset, upto - 1)
        run: list = []
        expected = task.next_offset
        async for message in self._reader.iter_range(tp[0], tp[1], task.next_offset, upto):
            if message.offset > expected:
                logger.warning("%s: offsets %d..%d are gone from the log (retention); what they held is lost",
                               name, expected, message.offset - 1)
            expected = message.offset + 1
            run.append(message)
            if len(run) >= self.settings.kafka_config.max_poll_records:  # folded as a fetch would be
                await self._fold_read(task, tp, run)
                run = []
        if run:
            await self._fold_read(task, tp, run)
        task.next_offset = max(task.next_offset, upto)

    async def _fold_read(self, task: Any, tp: TopicPartition, messages: list) -> None:
        await self.fold(task, tp, messages)
        for message in messages:
            self._acknowledge(message)

    def _lag_and_age(self, highwater: Callable[[str, int], int | None]) -> tuple[dict, dict]:
        lag, age = {}, {}
        for tp, task in sorted(self._tasks.items()):
            mark = highwater(*tp)
            if mark is not None and task.next_offset is not None:
                lag[tp] = max(0, mark - task.next_offset)
            if tp in self._checkpointed_at:
                age[(self.stage, tp[1])] = self._clock() - self._checkpointed_at[tp]
        return lag, age


class Stage1Runner(PartitionRunner):
    """Stage 1 on Kafka: decode and fold telemetry, send slice batches and dead letters."""

    stage = "stage1"
    task_type = Stage1Task

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: dict[TopicPartition, list[asyncio.Future]] = {}
        self.records = 0
        self.rejected = RejectionCounter()
        self.engines_seen: dict[str, float] = {}  # engine worker -> wall time of its newest record
        self.partials_sent = 0  # messages: a fetch's batches for one stage-2 partition travel in one
        self._idle = IdleRule(self.settings.source_silence_seconds)
        self._ends_read_at = -float("inf")

    def inputs(self) -> tuple[str, ...]:
        return self.settings.telemetry_topics

    def new_task(self, tp: TopicPartition) -> Stage1Task:
        return Stage1Task(self.settings.policy, f"{tp[0]}/{tp[1]}")

    async def taken_over(self, task: Stage1Task, tp: TopicPartition) -> None:
        self._idle.heard(task.source, self._clock())  # silence is counted from this worker's start

    async def fold(self, task: Stage1Task, tp: TopicPartition, messages: list) -> None:
        self._idle.heard(task.source, self._clock())
        before, now = task.records, time.time()
        pending = self._pending.setdefault(tp, [])
        closed: list = []
        closes: list = []  # for the decision trace: (watermark, produced, closed) of each close not sent yet
        after = self.settings.partials_after_seconds
        folding_since = self._clock()
        for message in messages:
            value = message.value or b""
            rejections, batches = task.fold(message.offset, value, now, self.engines_seen)
            if batches and self._trace:
                closes.append((batches[-1].watermark, timestamp_seconds(message.timestamp), time.time()))
            closed += batches
            for rejection in rejections:
                self.rejected.add(rejection)
                letter = dead_letter(rejection, tp[0], tp[1], message.offset)
                pending.append(await self._writer.send(self.settings.deadletter_topic, letter,
                                                       key=message.key))
            if after is not None and self._clock() - folding_since >= after:
                # What has closed goes now, not after the rest of the fetch, and the event
                # loop runs the producer and stage 2 before this fetch goes on folding.
                await self._send(task, tp, closed, (now, closes))
                closed, closes = [], []
                await asyncio.sleep(0)
                folding_since = self._clock()
        self.records += task.records - before
        await self._send(task, tp, closed, (now, closes))

    @property
    def _trace(self) -> bool:
        return self.settings.decision_trace is not None

    async def _send(self, task: Stage1Task, tp: TopicPartition, closed: list, stamp: tuple | None = None) -> None:
        """Closed slices to stage 2: one partials message per stage-2 partition (more only past the
        size limit), its batches in close order."""
        pending = self._pending.setdefault(tp, [])
        parts: dict[int, list] = {}
        for partition, batch in route_batches(closed, self.settings.partials_partitions):
            parts.setdefault(partition, []).append(batch)
        for partition, batches in sorted(parts.items()):
            for value in encode_partials(batches):
                headers = DecisionTrace.stamp(*stamp) if stamp is not None and stamp[1] else None
                pending.append(await self._writer.send(self.settings.partials_topic, value,
                                                       key=task.source.encode(), partition=partition,
                                                       headers=headers))
                self.partials_sent += 1

    async def before_checkpoint(self, task: Stage1Task, tp: TopicPartition) -> None:
        await acknowledged(self._pending.pop(tp, []), "slice batches")  # what the checkpoint says was sent, was

    def forgotten(self, tp: TopicPartition) -> None:
        self._pending.pop(tp, None)
        self._idle.forget(f"{tp[0]}/{tp[1]}")

    async def release_idle_sources(self) -> None:
        """Idle telemetry partitions (`IdleRule`) close their open slices and release themselves."""
        now = self._clock()
        silence = self.settings.source_silence_seconds
        if not self._idle.silent(now) or now - self._ends_read_at < silence / 2:
            return
        self._ends_read_at = now
        ends = {topic: await self._reader.end_offsets(topic) for topic in sorted({tp[0] for tp in self._tasks})}
        waiting = {task.source for tp, task in self._tasks.items() if ends[tp[0]].get(tp[1], 0) > task.next_offset}
        partitions = {task.source: tp for tp, task in self._tasks.items()}
        for source in self._idle.idle(now, waiting):
            async with self._lock:
                tp = partitions[source]
                task = self._tasks.get(tp)
                if task is None:
                    continue  # taken away meanwhile
                await self._send(task, tp, task.ingest.release())
                pending = self._pending.setdefault(tp, [])
                for partition in range(self.settings.partials_partitions):
                    pending.append(await self._writer.send(self.settings.partials_topic,
                                                           encode_release(source, task.stage.watermark),
                                                           key=source.encode(), partition=partition))
                await self.checkpoint(task, tp)
            logger.log(logging.WARNING if task.messages else logging.INFO,
                       "telemetry partition %s is idle (nothing sent for %.0f s, nothing left to read): its slices "
                       "are closed and stage 2 does not wait for it until it sends again", source, silence)

    def health(self, now: float, highwater: Callable[[str, int], int | None]) -> dict[str, dict]:
        """Lag, watermark delay and checkpoint age of every task this worker holds."""
        slice_seconds = self.settings.policy.windows.slice_seconds
        lag, age = self._lag_and_age(highwater)
        delay = {tp: now - (task.stage.watermark + 1) * slice_seconds
                 for tp, task in sorted(self._tasks.items()) if task.stage.watermark >= 0}
        return {"lag": lag, "delay": delay, "age": age}


class Stage2Runner(PartitionRunner):
    """Stage 2 on Kafka: merge and decide, publish decisions through the outbox, archive."""

    stage = "stage2"
    task_type = Stage2Task

    def __init__(self, *args: Any, keyring: Keyring | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Flag clients verify every decision against this keyring (see transport/signing.py);
        # without a configured key decisions go out unsigned and clients say so.
        self._sink = DecisionSink(self._writer.send, self.settings.decisions_topic,
                                  keyring if keyring is not None else Keyring.from_env(), role="a stream worker")
        self._beats = 0
        self._archive_sink = None
        # partition -> (ids of decisions on the decisions topic, the partition's end when its task
        # was taken over): what the task decides again before that end may have gone out already
        self._published_before: dict[TopicPartition, tuple[set[str], int]] = {}
        self.operations: Operations | None = None  # fed every final slice and every published decision
        self.decisions = 0
        self.slices = 0
        trace = self.settings.decision_trace
        self._trace = DecisionTrace(trace) if trace is not None else None

    def inputs(self) -> tuple[str, ...]:
        return (self.settings.partials_topic,)

    def new_task(self, tp: TopicPartition) -> Stage2Task:
        return Stage2Task(self.settings.policy, self.settings.sources,
                          BundleOwner(tp[1], self.settings.partials_partitions))

    def open_archive(self) -> None:
        if self.settings.archive_dsn and self._archive_sink is None:
            from specwatch.archive.sink import ArchiveSink

            self._archive_sink = ArchiveSink.open(self.settings.archive_dsn, require_archive=True)

    def close_archive(self) -> None:
        if self._archive_sink is not None:
            self._archive_sink.close()  # closes the archive it opened
            self._archive_sink = None

    def forgotten(self, tp: TopicPartition) -> None:
        self._published_before.pop(tp, None)

    async def taken_over(self, task: Stage2Task, tp: TopicPartition) -> None:
        if task.outbox:
            await self._finish_outbox(task, tp)
        # A task that folds again what it folded before (its checkpoint refused, gone or older than
        # its last decisions) decides it again under the same ids: those already out stay out once.
        end = (await self._reader.end_offsets(tp[0])).get(tp[1], 0)
        if end > task.next_offset:
            published = decisions_in(await self._reader.values_since(self.settings.decisions_topic, {}))
            if published:
                self._published_before[tp] = (published, end)
        # a sign of life as soon as a partition is taken over, not only at the next tick
        await self.heartbeat()

    async def fold(self, task: Stage2Task, tp: TopicPartition, messages: list) -> None:
        for message in messages:
            await self._fold_one(task, tp, message)

    async def _fold_one(self, task: Stage2Task, tp: TopicPartition, message: Any) -> None:
        partition = tp[1]
        received, merge_s, decide_s = time.time(), task.stage.merge_seconds, task.stage.decide_seconds
        partial = decode_partial(message.value or b"")
        if isinstance(partial, Rejection):
            logger.warning("partials %d@%d dropped: %s", partition, message.offset, partial.detail)
        outputs = task.fold(message.offset, partial)
        actions = []
        for output in outputs:
            self.slices += 1
            if self._archive_sink is not None:
                self._archive_sink(output)  # idempotent: a replayed slice writes the same rows
            if self.operations is not None:
                self.operations.view.observe(output, now=time.time())
            actions.extend(output.actions)
        before = self._published_before.get(tp)
        if before is not None:
            published, end = before
            pending = outbox_pending(actions, published)
            if len(pending) < len(actions):
                logger.info("%s: %d decisions it made before its restart are on the decisions topic already; "
                            "not published again", self.task_name(tp), len(actions) - len(pending))
                actions = pending
            if message.offset + 1 >= end:
                del self._published_before[tp]
        if actions:
            decided = checkpointed = time.time()
            task.outbox = actions  # decided, not yet acknowledged (`health`, the outbox gauge)
            if self.settings.checkpoint_before_publish:
                # Into the checkpoint first, then out: a crash in between publishes the rest on restart.
                task.outbox_mark = await self._reader.end_offsets(self.settings.decisions_topic)
                await self.checkpoint(task, tp)
                checkpointed = time.time()
            # Out first, the checkpoint on its schedule: decisions are a function of the partials
            # and their ids are stable, so a crash before the next checkpoint refolds from the last
            # one, decides the same again, and `taken_over` finds on the decisions topic which of
            # them went out (`outbox_pending`): the rest go out now, none twice.
            await self._publish(task, actions)
            if self._trace is not None:
                self._trace.write([output for output in outputs if output.actions], DecisionTrace.stamped(message),
                                  stage2_received=received, merge_s=task.stage.merge_seconds - merge_s,
                                  decide_s=task.stage.decide_seconds - decide_s, decided=decided,
                                  checkpointed=checkpointed, published=time.time())

    async def before_checkpoint(self, task: Stage2Task, tp: TopicPartition) -> None:
        if self._archive_sink is not None:
            self._archive_sink.flush()  # the archive holds everything the checkpoint covers

    async def _finish_outbox(self, task: Stage2Task, tp: TopicPartition) -> None:
        published = decisions_in(await self._reader.values_since(self.settings.decisions_topic, task.outbox_mark))
        missing = outbox_pending(task.outbox, published)
        logger.info("%s restarted with %d decisions in its outbox, %d not yet published",
                    self.task_name(tp), len(task.outbox), len(missing))
        await self._publish(task, missing)

    async def _publish(self, task: Stage2Task, actions: list) -> None:
        await self.publish_decisions([action.decision for action in actions])
        task.outbox = []
        task.outbox_mark = {}

    async def publish_decisions(self, decisions: list) -> None:
        """Sign and publish decisions on the decisions topic; return once the broker has them all."""
        sent = []
        for decision in decisions:
            sent.append(await self._sink.decision(decision))
            logger.info("decision %s %s %s reason=%s ts=%.3f", decision.id, decision.action, decision.key,
                        decision.reason, decision.ts)
        await acknowledged(sent, "decisions")
        self.decisions += len(sent)
        if self.operations is not None:
            self.operations.published(decisions)

    def archive_decisions(self, actions: list) -> None:
        """Archive decisions made beside the slices (Alertmanager rollbacks) with their audit rows."""
        if self._archive_sink is not None:
            self._archive_sink.write_actions(actions)

    def archived_decisions(self, detector: str) -> list:
        """Every decision of ``detector`` the archive (and its spool) holds, oldest first."""
        return self._archive_sink.decisions_by(detector) if self._archive_sink is not None else []

    def cards(self) -> dict[str, dict]:
        """Bundle id -> card of every bundle the stage-2 tasks of this worker have seen."""
        return {bundle: card for task in self._tasks.values() for bundle, card in task.stage.decider.cards.items()}

    def automatic(self, scope: tuple) -> Any:
        """The `ScopeState` this worker's decisions alone give ``scope`` (None: speculation on)."""
        for task in self._tasks.values():
            if scope[0] in task.stage.decider.cards:
                return task.stage.decider.flags.state(scope)
        return None

    def stages(self) -> list:
        """The `Stage2` of every task this worker holds (what the metrics view reads)."""
        return [task.stage for _, task in sorted(self._tasks.items())]

    def health(self, now: float, highwater: Callable[[str, int], int | None]) -> dict:
        """Lag and checkpoint age per partials partition, the outbox, the archive spool."""
        lag, age = self._lag_and_age(highwater)
        spool = self._archive_sink.spool.pending_bytes if self._archive_sink is not None else None
        return {"lag": lag, "age": age, "outbox": sum(len(t.outbox) for t in self._tasks.values()),
                "spool": spool}

    async def heartbeat(self) -> None:
        """A signed heartbeat per owned partials partition: the event time decided up to."""
        slice_seconds = self.settings.policy.windows.slice_seconds
        for tp in sorted(self._assignment()):
            if tp[0] != self.settings.partials_topic:
                continue
            task = self._tasks.get(tp)
            finalized = task.stage.finalized if task is not None else -1
            self._beats += 1
            await self._sink.heartbeat(f"{self.settings.app_id}/stage2-{tp[1]}", self._beats,
                                       (finalized + 1) * slice_seconds if finalized >= 0 else None)
