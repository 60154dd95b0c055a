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

__all__ = ["LATENCY_PARTS", "admin_call", "create_topics", "latency_breakdown", "run_kafka_bench"]

_PARTITIONS = 4
# Where a decision's time after its evidence goes, in path order (`latency_breakdown`).
LATENCY_PARTS = ("slice_and_lateness", "stage1_queueing", "stage1_fold_to_close", "stage1_fold_after_close",
                 "partials_topic", "stage2_merge", "decider", "stage2_other", "checkpoint", "publish", "read_back")
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


def _evidence_walls(decisions: list, produced: list[tuple[float, float]]) -> list[float | None]:
    """Per decision: the wall time its slice end was first handed to the producer (None: never).

    ``decisions`` are (wall, Decision) pairs; ``produced`` (wall, highest event time so far)
    per producer batch, in order.

    >>> from types import SimpleNamespace as D
    >>> _evidence_walls([(12.5, D(ts=105.0)), (20.0, D(ts=200.0))], [(10.0, 100.0), (11.0, 106.0)])
    [11.0, None]
    """
    import bisect

    marks = [ts for _, ts in produced]
    out: list[float | None] = []
    for _, decision in decisions:
        i = bisect.bisect_left(marks, decision.ts)
        out.append(produced[i][0] if i < len(produced) else None)
    return out


def latency_breakdown(evidence: float, read_back: float, trace: dict) -> dict[str, float]:
    """One decision's time from its evidence (handed to the producer at ``evidence``) to its
    read-back, split at the wall times of its `DecisionTrace` line; the parts sum to the whole.

    >>> line = {"telemetry_produced": 10.1, "fetch_taken": 10.6, "slice_closed": 10.7, "partials_sent": 11.5,
    ...         "stage2_received": 11.9, "merge_s": 0.01, "decide_s": 0.05, "decided": 12.0,
    ...         "checkpointed": 12.2, "published": 12.3}
    >>> parts = latency_breakdown(10.0, 12.4, line)
    >>> {k: round(v, 2) for k, v in parts.items()}  # doctest: +NORMALIZE_WHITESPACE
    {'slice_and_lateness': 0.1, 'stage1_queueing': 0.5, 'stage1_fold_to_close': 0.1, 'stage1_fold_after_close': 0.8,
     'partials_topic': 0.4, 'stage2_merge': 0.01, 'decider': 0.05, 'stage2_other': 0.04, 'checkpoint': 0.2,
     'publish': 0.1, 'read_back': 0.1}
    >>> round(sum(parts.values()), 6) == round(12.4 - 10.0, 6)
    True
    """
    t = trace
    return dict(zip(LATENCY_PARTS, (
        t["telemetry_produced"] - evidence, t["fetch_taken"] - t["telemetry_produced"],
        t["slice_closed"] - t["fetch_taken"], t["partials_sent"] - t["slice_closed"],
        t["stage2_received"] - t["partials_sent"], t["merge_s"], t["decide_s"],
        t["decided"] - t["stage2_received"] - t["merge_s"] - t["decide_s"],
        t["checkpointed"] - t["decided"], t["published"] - t["checkpointed"], read_back - t["published"])))


def _breakdowns(received: list, produced: list[tuple[float, float]], trace_path: str) -> list[dict]:
    """Every decision read back that the trace stamped: its id, latency and `latency_breakdown`."""
    import json

    try:
        with open(trace_path) as lines:
            traces = {row["id"]: row for row in map(json.loads, lines)}
    except FileNotFoundError:
        return []
    out = []
    for (wall, decision), evidence in zip(received, _evidence_walls(received, produced)):
        row = traces.get(decision.id)
        if evidence is None or row is None or row.get("telemetry_produced") is None:
            continue
        out.append({"id": decision.id, "ts": decision.ts, "latency_s": wall - evidence,
                    "parts": latency_breakdown(evidence, wall, row)})
    return out


def _summary(breakdowns: list[dict]) -> dict:
    """Per part: its median over the decisions, and the parts of the slowest decision."""
    if not breakdowns:
        return {}
    slowest = max(breakdowns, key=lambda b: b["latency_s"])
    return {"decisions": len(breakdowns),
            "median_s": {part: percentile([b["parts"][part] for b in breakdowns], 0.5) for part in LATENCY_PARTS},
            "slowest_s": slowest["latency_s"], "slowest_parts_s": slowest["parts"]}


def _tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` and all its descendants (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            with open(f"/proc/{current}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{current}/task/{current}/children") as children:
                todo += [int(child) for child in children.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue  # ended meanwhile
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def _encoded(batch: list, max_bytes: int) -> list[tuple[bytes, bytes]]:
    """The messages the engines' Kafka exporter sends for ``batch``: keyed by worker, chunked below ``max_bytes``."""
    from specwatch.schemas.otlp import iter_encoded_chunks, log_entry

    groups: dict[str, list] = {}
    for record in batch:
        groups.setdefault(getattr(record, "worker", None) or record.bundle_id, []).append(log_entry(record))
    return [(key.encode(), payload) for key, entries in groups.items()
            for payload, _ in iter_encoded_chunks(entries, max_bytes=max_bytes)]


def run_kafka_bench(bootstrap: str, seconds: float = 60.0, smoke: bool = False, workers: int = 1,
                    rate: float | None = None, worker_env: dict[str, str] | None = None,
                    partitions: int = _PARTITIONS, policy: str | None = None) -> dict:
    """One end-to-end run; ``rate`` paces the producer at that many rounds/s (None: flat out);
    ``partitions`` of the telemetry and partials topics; ``policy``: a policy file for the workers."""
    from specwatch.transport.clients import FROM_EARLIEST, kafka_consumer, kafka_producer
    from specwatch.transport.codec import HEARTBEAT_KEY_PREFIX
    from specwatch.transport.config import KafkaConfig
    from specwatch.lab.simulation.simulator import Simulator
    from specwatch.schemas import Decision
    from specwatch.streams.embedded import EmbeddedPipeline
    from specwatch.streams.decision_trace import DECISION_TRACE_ENV

    run = f"swbench-{uuid.uuid4().hex[:6]}"
    topics = {f"{run}.telemetry": partitions, f"{run}.partials": partitions, f"{run}.deadletter": partitions,
              f"{run}.decisions": 1}
    asyncio.run(create_topics(bootstrap, topics))
    # long enough that the end of the drain is a small part of the full run (docs/BENCHMARKS.md)
    minutes = 1.5 if smoke else (3.5 if seconds < 60 else 18.0)
    sim = Simulator("demo", seed=17, minutes=minutes, workers=4, concurrency=16, incident_at=45.0 if smoke else 60.0)
    records = list(sim.records())
    rounds = sum(len(r.requests) for r in records if r.kind == "step")
    from specwatch.schemas.policy import load_policy

    embedded = EmbeddedPipeline(load_policy(policy)) if policy else EmbeddedPipeline()
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
               "--web-port", "0",  # no web server: the bench must not collide with a running worker's port
               *(["--policy", policy] if policy else [])]
    trace_path = f"{tmp.name}/decisions.trace"
    config = KafkaConfig(bootstrap, topic=f"{run}.telemetry")
    batches = [records[i:i + _BATCH] for i in range(0, len(records), _BATCH)]
    encoded = [_encoded(batch, config.max_request_size - 16 * 1024) for batch in batches]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, DECISION_TRACE_ENV: trace_path,
                                                                               **(worker_env or {})})
    try:
        time.sleep(8.0)  # group join and assignment before the clock starts
        producer = kafka_producer(config)
        first_incident_wall: dict[int, float] = {}
        lag_samples: list[tuple[float, int]] = []
        produced: list[tuple[float, float]] = []  # (wall, highest event time handed over)
        t0 = time.time()
        cpu_at_start = _tree_cpu_seconds(process.pid)  # the workers' start-up and group join left out
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
        worker_cpu_s = _tree_cpu_seconds(process.pid) - cpu_at_start
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
    after_evidence = [wall - evidence for (wall, _), evidence in zip(received, _evidence_walls(received, produced))
                      if evidence is not None]
    breakdowns = _breakdowns(received, produced, trace_path)
    ended_early = lag_samples[-1][1] != 0 if lag_samples else True
    with open(f"{tmp.name}/run.log", errors="replace") as written:
        log_tail = written.read()[-4000:] if ended_early else None  # why the workers stopped, kept in the report
    tmp.cleanup()
    embedded_lines = sorted(d.to_json_line() for d in embedded.decisions)
    kafka_lines = sorted(d.to_json_line() for _, d in received)
    return {
        "records": len(records), "rounds": rounds, "incidents": len(sim.incidents),
        "producer_s": produced_s, "drained_s": drained_s, "drained": lag_samples[-1][1] == 0 if lag_samples else False,
        "rounds_per_s": rounds / drained_s, "producer_rounds_per_s": rounds / produced_s,
        # the workers' CPU counts only while they all ran to the drain
        "worker_cpu_s": None if ended_early else worker_cpu_s,
        "rounds_per_worker_cpu_s": rounds / worker_cpu_s if worker_cpu_s > 0 and not ended_early else None,
        "embedded_fast_rounds_per_s": rounds / embedded_s,
        "kafka_over_embedded": (rounds / drained_s) / (rounds / embedded_s),
        "lag_samples": lag_samples, "decisions": len(received), "embedded_decisions": len(embedded.decisions),
        "same_decisions_as_embedded": embedded_lines == kafka_lines,
        "decision_latency_s": latencies, "decision_latency_p50_s": percentile(latencies, 0.5),
        "decision_latency_p99_s": percentile(latencies, 0.99), "workers": workers,
        "evidence_latency_p50_s": percentile(after_evidence, 0.5),
        "evidence_latency_p99_s": percentile(after_evidence, 0.99),
        "evidence_latency_max_s": max(after_evidence, default=None),
        "paced_rounds_per_s": rate, "worker_env": dict(worker_env or {}), "partitions": partitions,
        "policy": policy, "evidence_breakdown": _summary(breakdowns), "evidence_breakdowns": breakdowns,
        "telemetry_messages": sum(len(m) for m in encoded),
        "event_seconds_per_wall_second": (records[-1].ts - records[0].ts) / produced_s,
        "lag_max": max((lag for _, lag in lag_samples if lag is not None), default=None),
        "worker_log_tail": log_tail,
        "note": ("producer paced at %.0f rounds/s" % rate) if rate else
                "produced as fast as the producer goes; throughput = rounds / time to zero lag",
    }
