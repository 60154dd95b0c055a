"""The distributed path's test rig: seeded telemetry on the real broker, `specwatch run` workers,
and what they published."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import GroupCoordinatorNotAvailableError

from specwatch.actions.flags import FlagStore
from specwatch.archive.store import Archive
from specwatch.lab.simulation.simulator import Simulator
from specwatch.schemas import Decision
from specwatch.schemas.otlp import encode_entries, log_entry
from specwatch.transport.kafka_io import PartitionReader

from telemetry_log import decision_key, replayed

SEED = 11
WORKERS = 3
MINUTES = 2.5
INCIDENT_AT = 90.0
PARTITIONS = 4
TAIL_SECONDS = 5.0
DRAIN_TIMEOUT_S = 600.0  # a liveness bound, not a speed claim: loaded 2-core CI machines are slow
RUN = uuid.uuid4().hex[:8]


def run_async(coro):
    return asyncio.run(coro)


@contextlib.asynccontextmanager
async def _admin(bootstrap: str):
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        yield admin
    finally:
        await admin.close()


async def create_topics(bootstrap: str, *topics: NewTopic) -> None:
    async with _admin(bootstrap) as admin:
        await admin.create_topics(list(topics))


async def delete_topics(bootstrap: str, prefix: str) -> None:
    """Drop every topic whose name starts with ``prefix`` (the broker outlives the test run)."""
    async with _admin(bootstrap) as admin:
        names = [name for name in await admin.list_topics() if name.startswith(prefix)]
        if names:
            await admin.delete_topics(names)


async def committed_offsets(bootstrap: str, group: str, topic: str) -> dict[int, int]:
    async with _admin(bootstrap) as admin:
        offsets = await admin.list_consumer_group_offsets(
            group, partitions=[TopicPartition(topic, p) for p in range(PARTITIONS)])
    return {tp.partition: max(meta.offset, 0) for tp, meta in offsets.items()}


async def send_raw(bootstrap: str, topic: str, messages: list[tuple[bytes, bytes]]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        for key, value in messages:
            await producer.send_and_wait(topic, value, key=key)
    finally:
        await producer.stop()


def bad_records(scenario: str) -> list[tuple[bytes, bytes]]:
    """Two (key, value) messages no processor may fold: bytes that are not OTLP, and a step of ``scenario``'s
    fleet whose rounds accept more than they drafted."""
    step = next(r for r in Simulator(scenario, seed=SEED, workers=1, minutes=0.05).records() if r.kind == "step")
    entry = log_entry(step)
    attributes = dict(entry.attributes)
    attributes["specwatch.requests.accepted"] = tuple(d + 1 for d in attributes["specwatch.requests.drafted"])
    return [(b"w1", b"\xff\xff not protobuf"), (b"w2", encode_entries([entry._replace(attributes=attributes)]))]


def topic_messages(bootstrap: str, topic: str) -> list:
    """Every message on ``topic`` as it is now, partition by partition, each in offset order."""
    reader = PartitionReader(bootstrap)
    ends = run_async(reader.end_offsets(topic))
    return [m for partition, end in sorted(ends.items()) for m in run_async(reader.read(topic, partition, 0, end))]


def topic_values(bootstrap: str, topic: str) -> list[tuple[bytes | None, bytes]]:
    """Every (key, value) on ``topic``, partition by partition."""
    return [(m.key, m.value) for m in topic_messages(bootstrap, topic)]


def published_decisions(bootstrap: str, topic: str) -> list[Decision]:
    """Every decision on a decisions topic, in order (heartbeats left out)."""
    return [Decision.model_validate_json(value) for key, value in topic_values(bootstrap, topic)
            if not key.startswith(b"__heartbeat__/")]


def start_logged(command: list[str], log_path: Path) -> subprocess.Popen:
    """``command`` started with its stdout and stderr in ``log_path``."""
    with open(log_path, "w") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


def stop_processes(processes: list[subprocess.Popen]) -> None:
    """SIGTERM to every process still running, then wait for each (killed after 60 s)."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class Feed:
    """One scenario's telemetry on its own topic, and what the embedded pipeline decides on it."""

    scenario: str
    topic: str
    cutoff: float
    expected: list[tuple]
    expected_flags: dict
    telemetry_records: int


def flag_view(store: FlagStore) -> dict:
    return {scope: (s.enabled, s.draft_limit, s.reason, s.ts) for scope, s in store.scopes().items()}


def make_feed(kafka_bootstrap: str, scenario: str, workers: int = WORKERS) -> Feed:
    topic = f"swtest-{RUN}-{scenario}-{workers}.telemetry"
    run_async(create_topics(kafka_bootstrap, NewTopic(topic, PARTITIONS, 1)))
    producer = subprocess.Popen(
        [sys.executable, "-m", "specwatch.cli", "simulate", "--bootstrap", kafka_bootstrap, "--topic", topic,
         "--scenario", scenario, "--seed", str(SEED), "--workers", str(workers), "--minutes", str(MINUTES),
         "--incident-at", str(INCIDENT_AT)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # The embedded run over the same records, meanwhile, on the other core.
    sim = Simulator(scenario, seed=SEED, workers=workers, minutes=MINUTES, incident_at=INCIDENT_AT)
    pipeline = replayed(sim.records())
    _, err = producer.communicate(timeout=300)
    assert producer.returncode == 0, err
    run_async(send_raw(kafka_bootstrap, topic, bad_records(scenario)))
    cutoff = sim.end_ts - TAIL_SECONDS
    expected = sorted(decision_key(d) for d in pipeline.decisions if d.ts < cutoff)
    flags = FlagStore()
    for decision in pipeline.decisions:
        if decision.ts < cutoff:
            flags.apply(decision)
    assert expected, f"scenario {scenario} decides nothing: the comparison would be empty"
    return Feed(scenario, topic, cutoff, expected, flag_view(flags), pipeline.counters.records)


class Pipeline:
    """A test's own topics and consumer group, and its `specwatch run` worker processes (on the
    listener ``worker_bootstrap``, by default the one the test's own helpers use)."""

    def __init__(self, bootstrap: str, feed: Feed, tmp_path: Path, archive: bool = False,
                 worker_bootstrap: str | None = None) -> None:
        self.bootstrap = bootstrap
        self.worker_bootstrap = worker_bootstrap or bootstrap
        self.feed = feed
        self.tmp_path = tmp_path
        name = f"swtest-{RUN}-{uuid.uuid4().hex[:6]}"
        self.app_id = name
        self.partials = f"{name}.partials"
        self.decisions = f"{name}.decisions"
        self.deadletter = f"{name}.deadletter"
        self.archive = f"chdb://{tmp_path}/archive" if archive else None
        self.processes: list[subprocess.Popen] = []
        run_async(create_topics(
            bootstrap, NewTopic(self.partials, PARTITIONS, 1), NewTopic(self.deadletter, PARTITIONS, 1),
            NewTopic(self.decisions, 1, 1, topic_configs={"cleanup.policy": "compact"})))

    def start(self, index: int = 0, workers: int = 1, checkpoint_seconds: float = 1.0) -> subprocess.Popen:
        command = [sys.executable, "-m", "specwatch.cli", "run", "--bootstrap", self.worker_bootstrap,
                   "--telemetry-topic", self.feed.topic, "--partials-topic", self.partials,
                   "--decisions-topic", self.decisions, "--deadletter-topic", self.deadletter,
                   "--app-id", self.app_id, "--data-dir", str(self.tmp_path / "data"),
                   "--workers", str(workers), "--worker-index", str(index),
                   "--session-timeout", "6", "--source-silence", "5",
                   "--checkpoint-seconds", str(checkpoint_seconds), "--log-level", "info"]
        if self.archive:
            command += ["--archive", self.archive]
        process = start_logged(command, self.tmp_path / f"worker-{index}-{len(self.processes)}.log")
        self.processes.append(process)
        return process

    def decide(self, **start) -> list[Decision]:
        """Start a worker, wait until it drained the feed; check what it published."""
        self.start(**start)
        self.wait_drained()
        return assert_same_decisions(self, self.feed)

    def wait_until(self, worker: subprocess.Popen, condition) -> None:
        """Until ``condition()`` holds, with ``worker`` running all along."""
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while not condition():
            assert worker.poll() is None, self.logs()
            assert time.monotonic() < deadline, self.logs()
            time.sleep(0.1)

    def assert_archived(self, published: list[Decision]) -> None:
        """Once the workers stopped (chDB opens a directory in one process at a time): the archive
        holds ``published`` and window stats."""
        self.stop()
        with Archive.open(self.archive, create=False) as archive:
            archived = archive.decisions(limit=None)
            assert sorted(r["decision_id"] for r in archived) == sorted(d.id for d in published)
            assert archive.timeline(), "window stats were archived"

    def progress(self) -> float:
        """Share of the telemetry the group has committed."""
        reader = PartitionReader(self.bootstrap)
        ends = run_async(reader.end_offsets(self.feed.topic))
        try:
            committed = run_async(committed_offsets(self.bootstrap, self.app_id, self.feed.topic))
        except GroupCoordinatorNotAvailableError:
            return 0.0  # a fresh broker has no group coordinator until the first worker joins
        return sum(committed.get(p, 0) for p in ends) / max(1, sum(ends.values()))

    def wait_drained(self, timeout: float = DRAIN_TIMEOUT_S) -> None:
        """Until the group has committed every telemetry and partials message and the decisions are out.

        Stage 2 may still wait for a silent partition after the commits: decisions are awaited too.
        """
        reader = PartitionReader(self.bootstrap)
        sources = [f"{topic}/{p}" for topic in (self.feed.topic, self.partials) for p in range(PARTITIONS)]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for process in self.processes[-1:]:
                assert process.poll() is None, f"worker exited with {process.returncode}: {self.logs()}"
            decided = [d for d in self.published() if d.ts < self.feed.cutoff]
            if len(decided) >= len(self.feed.expected) and run_async(reader.drained(self.app_id, sources)) == set(sources):
                return
            time.sleep(1.0)
        raise AssertionError(f"the pipeline did not drain within {timeout:.0f} s: {self.logs()}")

    def stop(self) -> None:
        stop_processes(self.processes)

    def published(self) -> list[Decision]:
        return published_decisions(self.bootstrap, self.decisions)

    def heartbeats(self) -> list[dict]:
        return [json.loads(value) for key, value in topic_values(self.bootstrap, self.decisions)
                if key.startswith(b"__heartbeat__/")]

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n" + p.read_text()[-3000:] for p in sorted(self.tmp_path.glob("worker-*.log")))


@pytest.fixture
def pipeline_factory(kafka_bootstrap, tmp_path):
    made: list[Pipeline] = []

    def make(feed: Feed, archive: bool = False) -> Pipeline:
        pipeline = Pipeline(kafka_bootstrap, feed, tmp_path, archive=archive)
        made.append(pipeline)
        return pipeline

    yield make
    for pipeline in made:
        pipeline.stop()


def assert_same_decisions(pipeline: Pipeline, feed: Feed) -> list[Decision]:
    published = pipeline.published()
    ids = Counter(d.id for d in published)
    assert not [i for i, n in ids.items() if n > 1], "a decision reached the decisions topic twice"
    got = sorted(decision_key(d) for d in published if d.ts < feed.cutoff)
    assert got == feed.expected, pipeline.logs()
    return published
