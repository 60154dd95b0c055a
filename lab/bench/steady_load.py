"""The soak run behind `specwatch soak`: a seeded healthy fleet in real time, sampling RSS and lag,
then judging from a fitted line whether both stayed flat."""

from __future__ import annotations

import math
import resource
import statistics
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Iterator, TextIO

__all__ = ["Sample", "SoakResult", "run_soak", "slope_per_minute", "summarize", "workers_for"]

# Calibration: how many records/s one simulated worker emits, measured over this much event time.
_CALIBRATION_MINUTES = 0.1
_CALIBRATION_WORKERS = 2
# The first part of a run warms caches, baselines and sketches: slopes are fitted after it.
_WARMUP_SHARE = 0.2
# Flat means: memory grows less than this per minute, and lag neither grows by more than
# this per minute nor exceeds the bound at any sample after the warm-up.
_FLAT_RSS_MB_PER_MIN = 1.0
_FLAT_LAG_S_PER_MIN = 0.05
_MAX_STEADY_LAG_S = 10.0
_KAFKA_POLL_MS = 200


@dataclass(frozen=True)
class Sample:
    """One observation: seconds since start, RSS (MB), the worst lag of a decided slice behind
    wall time in the interval (s), records in, and the queues between (Kafka mode)."""

    t: float
    rss_mb: float
    lag_s: float
    records: int
    emit_queue: int = 0
    consumer_lag: int = 0


@dataclass(frozen=True)
class SoakResult:
    mode: str
    minutes: float
    rate_target: float
    rate_achieved: float
    records: int
    rejected: int
    decisions: int
    samples: int
    rss_start_mb: float
    rss_end_mb: float
    rss_max_mb: float
    rss_slope_mb_per_min: float
    lag_mean_s: float
    lag_max_s: float
    lag_slope_s_per_min: float
    max_emit_queue: int
    max_consumer_lag: int
    dropped: int
    failed: int
    memory_flat: bool
    lag_flat: bool


def slope_per_minute(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (seconds), per minute; nan with fewer than 2 points.

    >>> slope_per_minute([0.0, 60.0, 120.0], [10.0, 11.0, 12.0])
    1.0
    """
    try:
        return statistics.linear_regression(xs, ys).slope * 60.0
    except statistics.StatisticsError:  # fewer than two points, or all at one time
        return math.nan


def summarize(mode: str, minutes: float, rate: float, samples: list[Sample], counters: dict,
              dropped: int = 0, failed: int = 0) -> SoakResult:
    """Fit the samples after the warm-up and judge whether memory and lag stayed flat."""
    steady = [s for s in samples if s.t >= samples[-1].t * _WARMUP_SHARE] if samples else []
    if len(steady) < 2:
        steady = samples
    ts = [s.t for s in steady]
    rss_slope = slope_per_minute(ts, [s.rss_mb for s in steady])
    lag_slope = slope_per_minute(ts, [s.lag_s for s in steady])
    lags = [s.lag_s for s in steady]
    elapsed = samples[-1].t if samples else 0.0
    records = counters.get("records", 0)
    return SoakResult(
        mode=mode, minutes=minutes, rate_target=rate,
        rate_achieved=round(records / elapsed, 1) if elapsed else 0.0,
        records=records, rejected=counters.get("rejected", 0), decisions=counters.get("decisions", 0),
        samples=len(samples),
        rss_start_mb=samples[0].rss_mb if samples else math.nan,
        rss_end_mb=samples[-1].rss_mb if samples else math.nan,
        rss_max_mb=max((s.rss_mb for s in samples), default=math.nan),
        rss_slope_mb_per_min=round(rss_slope, 3),
        lag_mean_s=round(sum(lags) / len(lags), 3) if lags else math.nan,
        lag_max_s=round(max(lags), 3) if lags else math.nan,
        lag_slope_s_per_min=round(lag_slope, 4),
        max_emit_queue=max((s.emit_queue for s in samples), default=0),
        max_consumer_lag=max((s.consumer_lag for s in samples), default=0),
        dropped=dropped, failed=failed,
        memory_flat=not math.isnan(rss_slope) and rss_slope < _FLAT_RSS_MB_PER_MIN,
        lag_flat=not math.isnan(lag_slope) and lag_slope < _FLAT_LAG_S_PER_MIN
        and bool(lags) and max(lags) < _MAX_STEADY_LAG_S,
    )


def _rss_mb() -> float:
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # peak, not current: a fallback


def workers_for(rate: float, seed: int) -> int:
    """How many simulated workers emit about ``rate`` records per second."""
    from specwatch.lab.simulation.simulator import Simulator

    sim = Simulator("healthy", seed=seed, minutes=_CALIBRATION_MINUTES, workers=_CALIBRATION_WORKERS)
    per_worker = sum(1 for _ in sim.records()) / (_CALIBRATION_MINUTES * 60.0) / _CALIBRATION_WORKERS
    return max(1, min(4096, round(rate / per_worker)))


def _paced(records: Iterator, stop: threading.Event) -> Iterator:
    """Records when the wall clock reaches their event time: a fleet running now."""
    for record in records:
        delay = record.ts - time.time()
        if delay > 0 and stop.wait(delay):
            return
        if stop.is_set():
            return
        yield record


class _Sampler:
    """The run's pipeline, sampled every ``every_s``: RSS, queues, and how far behind wall time its
    slices were decided, worst per interval (at the output: slice length, lateness and backlog)."""

    def __init__(self, every_s: float, out: TextIO | None,
                 queues: Callable[[], tuple[int, int]] = lambda: (0, 0)) -> None:
        from specwatch.streams.embedded import EmbeddedPipeline

        self.pipeline = EmbeddedPipeline(sinks=[self._decided], clock=time.time)
        self.samples: list[Sample] = []
        self.every_s = every_s
        self._out = out
        self._queues = queues
        self.started = self._next = time.monotonic()
        self._worst = self._last = 0.0

    def _decided(self, output) -> None:
        self._last = max(0.0, time.time() - output.slice_end)
        self._worst = max(self._worst, self._last)

    def tick(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now >= self._next:
            self._next = now + self.every_s
            # the worst lag since the last sample, the latest one when no slice was decided since
            lag, self._worst = (self._worst or self._last), 0.0
            sample = Sample(round(now - self.started, 2), round(_rss_mb(), 1), round(lag, 3),
                            self.pipeline.counters.records, *self._queues())
            self.samples.append(sample)
            if self._out is not None:
                print(f"  t={sample.t:7.1f}s  rss={sample.rss_mb:7.1f} MB  lag={sample.lag_s:6.2f}s  "
                      f"records={sample.records:>9}  emit_queue={sample.emit_queue:>6}  "
                      f"consumer_lag={sample.consumer_lag:>6}", file=self._out, flush=True)

    def result(self, mode: str, minutes: float, rate: float, **failures: int) -> SoakResult:
        self.pipeline.finish()
        counters = self.pipeline.counters.as_dict()
        return summarize(mode, minutes, rate, self.samples, counters, **failures)


def _soak_embedded(sim, minutes: float, rate: float, sample_seconds: float, out: TextIO | None) -> SoakResult:
    sampler = _Sampler(sample_seconds, out)
    deadline = time.monotonic() + minutes * 60.0
    for record in _paced(sim.records(), threading.Event()):
        sampler.pipeline.feed(record)
        sampler.tick()
        if time.monotonic() >= deadline:
            break
    sampler.tick(force=True)
    return sampler.result("embedded", minutes, rate)


def _soak_kafka(sim, minutes: float, rate: float, sample_seconds: float, out: TextIO | None, bootstrap: str,
                topic: str | None) -> SoakResult:
    from kafka import TopicPartition
    from kafka.admin import NewTopic

    from specwatch.collectors.otel import TelemetryEmitter
    from specwatch.transport.clients import FROM_EARLIEST, kafka_admin, kafka_consumer
    from specwatch.transport.telemetry_exporter import KafkaTelemetryExporter
    from specwatch.transport.config import KafkaConfig
    from specwatch.schemas.otlp import decode_request

    config = KafkaConfig.from_env(bootstrap)
    own_topic = topic is None
    topic = topic or f"specwatch.soak.{uuid.uuid4().hex[:8]}"
    admin = None
    if own_topic:
        admin = kafka_admin(config)
        admin.create_topics([NewTopic(topic, 4, 1)])
    exporter = KafkaTelemetryExporter(KafkaConfig.from_env(bootstrap, topic=topic))
    emitter = TelemetryEmitter(exporter, sdk=False)
    consumer = kafka_consumer(config, **FROM_EARLIEST)
    stop = threading.Event()

    def load() -> None:
        for record in _paced(sim.records(), stop):
            emitter.emit(record)
        stop.set()

    producer_thread = threading.Thread(target=load, name="soak-load", daemon=True)
    partitions: list = []

    def queues() -> tuple[int, int]:
        ends = consumer.end_offsets(partitions) if partitions else {}
        behind = sum(max(0, end - consumer.position(tp)) for tp, end in ends.items())
        return emitter.stats().queued, behind

    sampler = _Sampler(sample_seconds, out, queues)
    try:
        deadline = time.monotonic() + 30
        while not consumer.partitions_for_topic(topic) and time.monotonic() < deadline:
            time.sleep(0.2)
        partitions = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
        consumer.assign(partitions)
        producer_thread.start()
        end_at = sampler.started + minutes * 60.0
        while time.monotonic() < end_at and not (stop.is_set() and not emitter.stats().queued):
            for batch in consumer.poll(timeout_ms=_KAFKA_POLL_MS).values():
                for message in batch:
                    sampler.pipeline.feed_many(decode_request(message.value))  # rejections counted
            sampler.tick()
        sampler.tick(force=True)
    finally:
        stop.set()
        producer_thread.join(10) if producer_thread.is_alive() else None
        emitter.shutdown()
        consumer.close()
        if admin is not None:
            try:
                admin.delete_topics([topic])
            finally:
                admin.close()
    stats = emitter.stats()
    return sampler.result("kafka", minutes, rate, dropped=stats.dropped,
                          failed=stats.failed + exporter.stats()["delivery_errors"])


def run_soak(minutes: float, rate: float, seed: int, sample_seconds: float, workers: int, *,
             bootstrap: str | None = None, topic: str | None = None, out: TextIO | None = None) -> SoakResult:
    """Run a seeded healthy fleet for ``minutes`` of wall time, through Kafka at ``bootstrap`` (on
    ``topic``, default a new topic deleted after) or embedded, printing each sample to ``out``."""
    from specwatch.lab.simulation.simulator import Simulator

    # A little more event time than wall time, so the load never runs out before the end.
    sim = Simulator("healthy", seed=seed, minutes=minutes + 1, workers=workers, start_ts=time.time())
    if bootstrap:
        return _soak_kafka(sim, minutes, rate, sample_seconds, out, bootstrap, topic)
    return _soak_embedded(sim, minutes, rate, sample_seconds, out)
