"""The end-to-end section of `specwatch bench`: simulated fleet -> Kafka -> `specwatch run` ->
decisions topic; throughput and decision latency beside the embedded pipeline (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

from specwatch.lab.bench import percentile, timed

__all__ = ["admin_call", "create_topics", "run_kafka_bench"]

_PARTITIONS = 4
_BATCH = 200
_DRAIN_TIMEOUT_S = 300.0
_SETTLE_TIMEOUT_S = 60.0


async def admin_call(bootstrap: str, method: str, *args, **kwargs):
    """One call of an aiokafka admin client of its own, e.g. ``delete_topics``."""
    from specwatch.transport.clients import aiokafka_admin
    from specwatch.transport.config import KafkaConfig

    admin = aiokafka_admin(KafkaConfig(bootstrap))
    await admin.start()
    try:
        return await getattr(admin, method)(*args, **kwargs)
    finally:
        await admin.close()


async def create_topics(bootstrap: str, names: dict[str, int]) -> None:
    """Topics of ``names`` -> partitions; a ``*.decisions`` topic is compacted."""
    from aiokafka.admin import NewTopic

    await admin_call(bootstrap, "create_topics", [
        NewTopic(name, parts, 1, topic_configs=(
            {"cleanup.policy": "compact"} if name.endswith(".decisions") else None))
        for name, parts in names.items()])


def _lag(bootstrap: str, group: str, topic: str) -> int | None:
    """Telemetry messages not yet committed by ``group``; None while that cannot be read."""
    from specwatch.transport.kafka_io import PartitionReader

    async def run():
        from aiokafka import TopicPartition

        ends = await PartitionReader(bootstrap).end_offsets(topic)
        offsets = await admin_call(bootstrap, "list_consumer_group_offsets", group,
                                   partitions=[TopicPartition(topic, p) for p in ends])
        committed = {tp.partition: max(meta.offset, 0) for tp, meta in offsets.items()}
        return sum(end - committed.get(p, 0) for p, end in ends.items())

    try:
        return asyncio.run(run())
    except Exception:  # noqa: BLE001 - the group's coordinator appears only once it has joined
        return None


def _evidence_latencies(decisions: list, produced: list[tuple[float, float]]) -> list[float]:
    """Per decision: read-back wall time minus the wall time its slice end was first produced.

    ``decisions`` are (wall, Decision) pairs; ``produced`` (wall, highest event time so far)
    per producer batch, in order.

    >>> from types import SimpleNamespace as D
    >>> _evidence_latencies([(12.5, D(ts=105.0)), (20.0, D(ts=200.0))], [(10.0, 100.0), (11.0, 106.0)])
    [1.5]
    """
    import bisect

    marks = [ts for _, ts in produced]
    out = []
    for wall, decision in decisions:
        i = bisect.bisect_left(marks, decision.ts)
        if i < len(produced):
            out.append(wall - produced[i][0])
    return out


def _encoded(batch: list, max_bytes: int) -> list[tuple[bytes, bytes]]:
    """The messages the engines' Kafka exporter sends for ``batch``: keyed by worker, chunked below ``max_bytes``."""
    from specwatch.schemas.otlp import iter_encoded_chunks, log_entry

    groups: dict[str, list] = {}
    for record in batch:
        groups.setdefault(getattr(record, "worker", None) or record.bundle_id, []).append(log_entry(record))
    return [(key.encode(), payload) for key, entries in groups.items()
            for payload, _ in iter_encoded_chunks(entries, max_bytes=max_bytes)]


def run_kafka_bench(bootstrap: str, seconds: float = 60.0, smoke: bool = False, workers: int = 1,
                    rate: float | None = None, worker_env: dict[str, str] | None = None) -> dict:
    """One end-to-end run; ``rate`` paces the producer at that many rounds/s (None: flat out)."""
    from specwatch.transport.clients import FROM_EARLIEST, kafka_consumer, kafka_producer
    from specwatch.transport.codec import HEARTBEAT_KEY_PREFIX
    from specwatch.transport.config import KafkaConfig
    from specwatch.lab.simulation.simulator import Simulator
    from specwatch.schemas import Decision
    from specwatch.streams.embedded import EmbeddedPipeline

    run = f"swbench-{uuid.uuid4().hex[:6]}"
    topics = {f"{run}.telemetry": _PARTITIONS, f"{run}.partials": _PARTITIONS, f"{run}.deadletter": _PARTITIONS,
              f"{run}.decisions": 1}
    asyncio.run(create_topics(bootstrap, topics))
    # long enough that the end of the drain is a small part of the full run (docs/BENCHMARKS.md)
    minutes = 1.5 if smoke else (3.5 if seconds < 60 else 18.0)
    sim = Simulator("demo", seed=17, minutes=minutes, workers=4, concurrency=16, incident_at=45.0 if smoke else 60.0)
    records = list(sim.records())
    rounds = sum(len(r.requests) for r in records if r.kind == "step")
    embedded = EmbeddedPipeline()
    embedded_s, _ = timed(lambda: [embedded.feed(record) for record in records] + embedded.finish(),
                          clock=time.perf_counter)

    received: list[tuple[float, Decision]] = []
    stop = threading.Event()

    def read_decisions():
        consumer = kafka_consumer(KafkaConfig(bootstrap), f"{run}.decisions", **FROM_EARLIEST,
                                  api_version=(2, 6), consumer_timeout_ms=500)
        while not stop.is_set():
            for message in consumer:
                if message.value and not (message.key or b"").startswith(HEARTBEAT_KEY_PREFIX.encode()):
                    received.append((time.time(), Decision.model_validate_json(message.value)))
        consumer.close()

    reader = threading.Thread(target=read_decisions, name="bench-decisions", daemon=True)
    reader.start()
    tmp = tempfile.TemporaryDirectory()
    log = open(f"{tmp.name}/run.log", "w")
    command = [sys.executable, "-m", "specwatch.cli", "run", "--bootstrap", bootstrap,
               "--telemetry-topic", f"{run}.telemetry", "--partials-topic", f"{run}.partials",
               "--decisions-topic", f"{run}.decisions", "--deadletter-topic", f"{run}.deadletter",
               "--app-id", run, "--data-dir", f"{tmp.name}/data", "--workers", str(workers),
               "--source-silence", "5", "--session-timeout", "6",
               "--web-port", "0"]  # no web server: the bench must not collide with a running worker's port
    config = KafkaConfig(bootstrap, topic=f"{run}.telemetry")
    batches = [records[i:i + _BATCH] for i in range(0, len(records), _BATCH)]
    encoded = [_encoded(batch, config.max_request_size - 16 * 1024) for batch in batches]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(worker_env or {})})
    try:
        time.sleep(8.0)  # group join and assignment before the clock starts
        producer = kafka_producer(config)
        first_incident_wall: dict[int, float] = {}
        lag_samples: list[tuple[float, int]] = []
        produced: list[tuple[float, float]] = []  # (wall, highest event time handed over)
        t0 = time.time()
        next_sample = t0
        sent_rounds = 0
        high_ts = 0.0
        for batch, messages in zip(batches, encoded):
            if rate:
                ahead = t0 + sent_rounds / rate - time.time()
                if ahead > 0:
                    time.sleep(ahead)
            for key, value in messages:
                producer.send(config.topic, key=key, value=value)
            sent_rounds += sum(len(r.requests) for r in batch if r.kind == "step")
            now = time.time()
            high_ts = max(high_ts, max(r.ts for r in batch))
            produced.append((now, high_ts))
            for n, incident in enumerate(sim.incidents):
                if n not in first_incident_wall and batch[-1].ts >= incident.start_ts:
                    first_incident_wall[n] = now
            if now >= next_sample:
                next_sample = now + 2.0
                lag_samples.append((now - t0, _lag(bootstrap, run, f"{run}.telemetry")))
        producer.flush()
        produced_s = time.time() - t0
        deadline = time.time() + _DRAIN_TIMEOUT_S
        while time.time() < deadline:
            lag = _lag(bootstrap, run, f"{run}.telemetry")
            lag_samples.append((time.time() - t0, lag))
            if lag == 0 or process.poll() is not None:
                break
            time.sleep(1.0)
        drained_s = time.time() - t0
        # Stage 2 decides the last slices after the telemetry is committed: wait for as many
        # decisions as the embedded pipeline made (bounded), and a little longer for any extra.
        settle_until = time.time() + _SETTLE_TIMEOUT_S
        while len(received) < len(embedded.decisions) and time.time() < settle_until and process.poll() is None:
            time.sleep(0.5)
        time.sleep(3.0)
        producer.close()
    finally:
        stop.set()
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
        reader.join(timeout=10)
    latencies = []
    for n, incident in enumerate(sim.incidents):
        hits = [wall for wall, d in received if d.reason == incident.expected_reason and d.ts >= incident.start_ts
                and d.bundle_id == incident.bundle_id]
        if hits and n in first_incident_wall:
            latencies.append(min(hits) - first_incident_wall[n])
    after_evidence = _evidence_latencies(received, produced)
    embedded_lines = sorted(d.to_json_line() for d in embedded.decisions)
    kafka_lines = sorted(d.to_json_line() for _, d in received)
    return {
        "records": len(records), "rounds": rounds, "incidents": len(sim.incidents),
        "producer_s": produced_s, "drained_s": drained_s, "drained": lag_samples[-1][1] == 0 if lag_samples else False,
        "rounds_per_s": rounds / drained_s, "producer_rounds_per_s": rounds / produced_s,
        "embedded_fast_rounds_per_s": rounds / embedded_s,
        "kafka_over_embedded": (rounds / drained_s) / (rounds / embedded_s),
        "lag_samples": lag_samples, "decisions": len(received), "embedded_decisions": len(embedded.decisions),
        "same_decisions_as_embedded": embedded_lines == kafka_lines,
        "decision_latency_s": latencies, "decision_latency_p50_s": percentile(latencies, 0.5),
        "decision_latency_p99_s": percentile(latencies, 0.99), "workers": workers,
        "evidence_latency_p50_s": percentile(after_evidence, 0.5),
        "evidence_latency_p99_s": percentile(after_evidence, 0.99),
        "evidence_latency_max_s": max(after_evidence, default=None),
        "paced_rounds_per_s": rate, "worker_env": dict(worker_env or {}),
        "telemetry_messages": sum(len(m) for m in encoded),
        "event_seconds_per_wall_second": (records[-1].ts - records[0].ts) / produced_s,
        "lag_max": max((lag for _, lag in lag_samples if lag is not None), default=None),
        "note": ("producer paced at %.0f rounds/s" % rate) if rate else
                "produced as fast as the producer goes; throughput = rounds / time to zero lag",
    }
