"""The end-to-end section of `specwatch bench`: simulated fleet -> Kafka -> `specwatch run` -> decisions topic.

Throughput is the processor's: rounds produced divided by the wall time until the consumer
group has committed them all; the same records through the embedded fast pipeline in
this process give the ratio. Decision latency runs from the wall time the first step of
an incident was handed to the producer to the wall time its decision was read back.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

__all__ = ["run_kafka_bench"]

_PARTITIONS = 4
_BATCH = 200
_DRAIN_TIMEOUT_S = 300.0


async def _create_topics(bootstrap: str, names: dict[str, int]) -> None:
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, parts, 1, topic_configs=(
            {"cleanup.policy": "compact"} if name.endswith(".decisions") else None)) for name, parts in names.items()])
    finally:
        await admin.close()


def _lag(bootstrap: str, group: str, topic: str) -> int | None:
    """Telemetry messages not yet committed by ``group``; None while that cannot be read."""
    from specwatch.streams.faust_app import PartitionReader

    async def run():
        from aiokafka import TopicPartition
        from aiokafka.admin import AIOKafkaAdminClient

        ends = await PartitionReader(bootstrap).end_offsets(topic)
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            offsets = await admin.list_consumer_group_offsets(group, partitions=[TopicPartition(topic, p) for p in ends])
        finally:
            await admin.close()
        committed = {tp.partition: max(meta.offset, 0) for tp, meta in offsets.items()}
        return sum(end - committed.get(p, 0) for p, end in ends.items())

    try:
        return asyncio.run(run())
    except Exception:  # noqa: BLE001 - the group's coordinator appears only once it has joined
        return None


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run_kafka_bench(bootstrap: str, seconds: float = 60.0, smoke: bool = False, workers: int = 1) -> dict:
    from kafka import KafkaConsumer

    from specwatch.collectors.otel import KafkaConfig, KafkaTelemetryExporter
    from specwatch.collectors.simulator import Simulator
    from specwatch.schemas import Decision
    from specwatch.streams.fastpath import FastPipeline

    run = f"swbench-{uuid.uuid4().hex[:6]}"
    topics = {f"{run}.telemetry": _PARTITIONS, f"{run}.partials": _PARTITIONS, f"{run}.deadletter": _PARTITIONS,
              f"{run}.decisions": 1}
    asyncio.run(_create_topics(bootstrap, topics))
    # event time runs far faster than wall time: several incidents in a few simulated minutes
    minutes = 1.5 if smoke else (3.5 if seconds < 60 else 6.0)
    sim = Simulator("demo", seed=17, minutes=minutes, workers=4, concurrency=16, incident_at=45.0 if smoke else 60.0)
    records = list(sim.records())
    rounds = sum(len(r.requests) for r in records if r.kind == "step")
    embedded = FastPipeline()
    start = time.perf_counter()
    for record in records:
        embedded.feed(record)
    embedded.finish()
    embedded_s = time.perf_counter() - start

    received: list[tuple[float, Decision]] = []
    stop = threading.Event()

    def read_decisions():
        consumer = KafkaConsumer(f"{run}.decisions", bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                 api_version=(2, 6), consumer_timeout_ms=500)
        while not stop.is_set():
            for message in consumer:
                if message.value:
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
               "--source-silence", "5", "--session-timeout", "6"]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        time.sleep(8.0)  # group join and assignment before the clock starts
        exporter = KafkaTelemetryExporter(KafkaConfig(bootstrap, topic=f"{run}.telemetry"))
        first_incident_wall: dict[int, float] = {}
        lag_samples: list[tuple[float, int]] = []
        t0 = time.time()
        next_sample = t0
        for i in range(0, len(records), _BATCH):
            batch = records[i:i + _BATCH]
            exporter.export(batch)
            now = time.time()
            for n, incident in enumerate(sim.incidents):
                if n not in first_incident_wall and batch[-1].ts >= incident.start_ts:
                    first_incident_wall[n] = now
            if now >= next_sample:
                next_sample = now + 2.0
                lag_samples.append((now - t0, _lag(bootstrap, run, f"{run}.telemetry")))
        exporter.force_flush()
        produced_s = time.time() - t0
        deadline = time.time() + _DRAIN_TIMEOUT_S
        while time.time() < deadline:
            lag = _lag(bootstrap, run, f"{run}.telemetry")
            lag_samples.append((time.time() - t0, lag))
            if lag == 0:
                break
            if process.poll() is not None:
                break
            time.sleep(1.0)
        drained_s = time.time() - t0
        time.sleep(3.0)
        exporter.shutdown()
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
    embedded_lines = sorted(d.to_json_line() for d in embedded.decisions)
    kafka_lines = sorted(d.to_json_line() for _, d in received)
    return {
        "records": len(records), "rounds": rounds, "incidents": len(sim.incidents),
        "producer_s": produced_s, "drained_s": drained_s, "drained": lag_samples[-1][1] == 0 if lag_samples else False,
        "rounds_per_s": rounds / drained_s, "producer_rounds_per_s": rounds / produced_s,
        "embedded_fast_rounds_per_s": rounds / embedded_s,
        "kafka_over_embedded": (rounds / drained_s) / (rounds / embedded_s),
        "lag_samples": lag_samples, "decisions": len(received),
        "same_decisions_as_embedded": embedded_lines == kafka_lines,
        "decision_latency_s": latencies, "decision_latency_p50_s": _percentile(latencies, 0.5),
        "decision_latency_p99_s": _percentile(latencies, 0.99), "workers": workers,
        "note": "produced as fast as the producer goes; throughput = rounds / time to zero lag",
    }
