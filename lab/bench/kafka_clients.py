"""The Kafka knobs of `specwatch bench --section kafka`: CPU per message of each client setting
(producing, consuming, stage-1 partials) beside the defaults, on one telemetry (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace
from typing import Any

from specwatch.lab.bench.kafka_path import admin_call, create_topics

__all__ = ["run_client_bench"]

_PARTITIONS = 4
_RECORDS_PER_MESSAGE = 50  # what one export call of the e2e bench puts in a message per engine worker
_FETCH_MESSAGES = 8  # telemetry messages per stage-1 fetch in the partials comparison
_REPEATS = 3


def _telemetry(smoke: bool) -> tuple[list[tuple[bytes, bytes]], int]:
    """OTLP telemetry messages keyed by engine worker, and the rounds they hold."""
    from specwatch.schemas.otlp import encode_entries, log_entry
    from specwatch.lab.simulation.simulator import Simulator

    sim = Simulator("demo", seed=17, minutes=0.5 if smoke else 2.0, workers=4, concurrency=16, incident_at=20.0)
    records = list(sim.records())
    rounds = sum(len(r.requests) for r in records if r.kind == "step")
    by_worker: dict[str, list] = {}
    messages = []
    for record in records:
        worker = getattr(record, "worker", None) or record.bundle_id
        group = by_worker.setdefault(worker, [])
        group.append(log_entry(record))
        if len(group) == _RECORDS_PER_MESSAGE:
            messages.append((worker.encode(), encode_entries(group)))
            group.clear()
    messages += [(worker.encode(), encode_entries(group)) for worker, group in by_worker.items() if group]
    return messages, rounds


def _produce(config: Any, messages: list[tuple[bytes, bytes]]) -> dict:
    """Send every message with a kafka-python producer made from ``config``; CPU and wall per message."""
    from specwatch.transport.clients import kafka_producer

    producer = kafka_producer(config)
    try:
        producer.send(config.topic, key=b"warm-up", value=b"").get(timeout=30)  # metadata, connection
        cpu, wall = time.process_time(), time.perf_counter()
        for key, value in messages:
            producer.send(config.topic, key=key, value=value)
        producer.flush(timeout=120)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    finally:
        producer.close()
    return {"cpu_us_per_message": cpu / len(messages) * 1e6, "wall_s": wall}


async def _consume(config: Any, count: int) -> dict:
    """Read ``count`` messages of ``config.topic`` from the beginning with an aiokafka consumer."""
    from specwatch.transport.clients import FROM_EARLIEST, aiokafka_consumer

    consumer = aiokafka_consumer(config, config.topic, **FROM_EARLIEST)
    await consumer.start()
    try:
        seen = polls = 0
        cpu, wall = time.process_time(), time.perf_counter()
        while seen < count:
            fetched = await consumer.getmany(timeout_ms=1000, max_records=config.max_poll_records)
            polls += 1
            seen += sum(len(batch) for batch in fetched.values())
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    finally:
        await consumer.stop()
    return {"cpu_us_per_message": cpu / seen * 1e6, "wall_s": wall, "messages_per_poll": seen / polls}


def _compressed_share(codec: str, messages: list[tuple[bytes, bytes]]) -> float:
    """Bytes after ``codec`` over bytes before, message by message (the producer compresses whole batches)."""
    from kafka import codec as codecs

    encode = {"none": lambda data: data, "lz4": codecs.lz4_encode, "zstd": codecs.zstd_encode,
              "gzip": codecs.gzip_encode}[codec]
    return sum(len(encode(value)) for _, value in messages) / sum(len(value) for _, value in messages)


def _best(runs: list[dict]) -> dict:
    return min(runs, key=lambda r: r["cpu_us_per_message"])


def _partials(bootstrap: str, messages: list[tuple[bytes, bytes]], topic: str, smoke: bool) -> dict:
    """Stage 1 -> stage 2 messages: one per closed slice and partition, or one per partition and fetch."""
    from specwatch.schemas import Policy
    from specwatch.streams.stage_tasks import Stage1Task, decode_partial, encode_partial, route_batches
    from specwatch.transport.clients import FROM_EARLIEST, aiokafka_consumer
    from specwatch.transport.config import KafkaConfig
    from specwatch.transport.kafka_io import KafkaWriter

    task = Stage1Task(Policy(), "bench/0")
    closes = []  # the slices each telemetry message closed
    for offset, (_, payload) in enumerate(messages):
        closes.append(list(task.fold(offset, payload)[1]))

    def singly() -> list[tuple[int, list]]:
        return [(partition, [batch]) for closed in closes for partition, batch in route_batches(closed, _PARTITIONS)]

    def per_fetch() -> list[tuple[int, list]]:
        out = []
        for i in range(0, len(closes), _FETCH_MESSAGES):
            parts: dict[int, list] = {}
            closed = [batch for batches in closes[i:i + _FETCH_MESSAGES] for batch in batches]
            for partition, batch in route_batches(closed, _PARTITIONS):
                parts.setdefault(partition, []).append(batch)
            out += sorted(parts.items())
        return out

    async def run(group: Any, name: str) -> dict:
        config = KafkaConfig(bootstrap)  # its fetch settings are aiokafka's defaults
        writer = KafkaWriter(config)
        consumer = aiokafka_consumer(config, name, **FROM_EARLIEST)
        try:
            await writer.send(name, b"", key=b"warm-up", partition=0)
            await consumer.start()
            cpu = time.process_time()
            plan = group()
            sent = [await writer.send(name, encode_partial(batches), key=b"bench/0", partition=partition)
                    for partition, batches in plan]
            await asyncio.gather(*sent)
            seen, batches = 0, 0
            while seen < len(plan) + 1:
                fetched = await consumer.getmany(timeout_ms=1000)
                for records in fetched.values():
                    for record in records:
                        seen += 1
                        if record.value:
                            batches += len(decode_partial(record.value).batches)
            cpu = time.process_time() - cpu
        finally:
            await consumer.stop()
            await writer.stop()
        return {"messages": len(plan), "batches": batches, "cpu_s": cpu,
                "cpu_us_per_message": cpu / len(plan) * 1e6, "cpu_us_per_batch": cpu / max(batches, 1) * 1e6}

    out = {}
    for label, group in (("per_slice", singly), ("per_fetch", per_fetch)):
        runs = []
        for i in range(1 if smoke else _REPEATS):
            name = f"{topic}.partials-{label}-{i}"
            asyncio.run(create_topics(bootstrap, {name: _PARTITIONS}))
            runs.append(asyncio.run(run(group, name)))
        out[label] = _best(runs)
    out["fetch_messages"] = _FETCH_MESSAGES
    out["messages_ratio"] = out["per_fetch"]["messages"] / out["per_slice"]["messages"]
    out["cpu_ratio"] = out["per_fetch"]["cpu_s"] / out["per_slice"]["cpu_s"]
    return out


def run_client_bench(bootstrap: str, smoke: bool = False) -> dict:
    """Every knob beside the defaults, on the same telemetry and broker."""
    from specwatch.transport.config import KafkaConfig

    messages, rounds = _telemetry(smoke)
    run = f"swknobs-{uuid.uuid4().hex[:6]}"
    base = KafkaConfig(bootstrap, topic=f"{run}.default")
    producers = {
        "default": {},
        "compression none": {"compression_type": "none"},
        "compression zstd": {"compression_type": "zstd"},
        "compression gzip": {"compression_type": "gzip"},
        "linger 5 ms, batch 16 KiB": {"linger_ms": 5, "batch_size": 16 * 1024},
        "linger 100 ms, batch 1 MiB": {"linger_ms": 100, "batch_size": 1024 * 1024},
    }
    consumers = {
        "default": {},
        "max_poll_records 100": {"max_poll_records": 100},
        "max_poll_records 2000": {"max_poll_records": 2000},
        "max_partition_fetch_bytes 256 KiB": {"max_partition_fetch_bytes": 256 * 1024},
        "max_partition_fetch_bytes 4 MiB": {"max_partition_fetch_bytes": 4 * 1024 * 1024},
        "fetch_max_bytes 1 MiB": {"fetch_max_bytes": 1024 * 1024},
    }
    topics = [f"{run}.{i}" for i in range(len(producers))]
    asyncio.run(create_topics(bootstrap, dict.fromkeys(topics, _PARTITIONS)))
    created = list(topics)
    try:
        produced = {}
        for (label, change), topic in zip(producers.items(), topics):
            config = replace(base, topic=topic, **change)
            produced[label] = _best([_produce(config, messages) for _ in range(1 if smoke else _REPEATS)])
            produced[label]["settings"] = {k: getattr(config, k) for k in ("compression_type", "linger_ms",
                                                                            "batch_size")}
            produced[label]["compressed_share"] = _compressed_share(config.compression_type, messages)
        consumed = {}
        for label, change in consumers.items():
            config = replace(base, topic=topics[0], **change)  # the default producer's topic
            consumed[label] = _best([asyncio.run(_consume(config, len(messages)))
                                     for _ in range(1 if smoke else _REPEATS)])
        partials = _partials(bootstrap, messages, run, smoke)
        created += [f"{run}.partials-{label}-{i}" for label in ("per_slice", "per_fetch")
                    for i in range(1 if smoke else _REPEATS)]
    finally:
        asyncio.run(admin_call(bootstrap, "delete_topics", created))
    for rows in (produced, consumed):
        default = rows["default"]["cpu_us_per_message"]
        for row in rows.values():
            row["over_default"] = row["cpu_us_per_message"] / default
    return {"messages": len(messages), "rounds": rounds, "records_per_message": _RECORDS_PER_MESSAGE,
            "bytes_per_message": sum(len(v) for _, v in messages) / len(messages),
            "produce": produced, "consume": consumed, "partials": partials}
