"""Prometheus metrics: a metrics view over stage 2, rendered at scrape time."""

from __future__ import annotations

import bisect
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Mapping, get_args

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from specwatch.actions.flags import FlagStore
from specwatch.schemas.slice_stats import ratio
from specwatch.schemas.decisions import Action, Reason
from specwatch.schemas.outputs import SliceOutput
from specwatch.schemas.scope import Scope

from .merge import Stage2

__all__ = [
    "DEFAULT_MAX_KEYS",
    "LatencyHistogram",
    "MetricsCollector",
    "MetricsView",
    "ServiceHealth",
]

# Label cardinality bound: keys beyond this many are not exported, and counted.
DEFAULT_MAX_KEYS = 2000
# Engine workers tracked for heartbeat age; more are counted as overflow too.
DEFAULT_MAX_WORKERS = 2000
# Seconds; from a slice closing in well under a second to a stream minutes behind.
_DEFAULT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_QUANTILES = ((0.5, "p50"), (0.95, "p95"), (0.99, "p99"))
_KEY_LABELS = ("bundle", "bucket", "cohort")
_WHOLE = "*"  # the label value of "every bucket" / "every cohort"
# (window row field, metric, help) of the per-key gauges
_KEY_GAUGES = (
    ("acceptance_length", "specwatch_acceptance_length",
     "Mean tokens per speculative round (accepted drafts + 1), newest window"),
    ("acceptance_rate", "specwatch_acceptance_rate_ratio",
     "Accepted draft tokens per drafted token, newest window"),
    ("draft_overhead", "specwatch_draft_overhead_ratio",
     "Share of step time spent drafting, newest window"),
    ("speedup", "specwatch_estimated_speedup_ratio",
     "Estimated speedup over standard decoding, newest window"),
    ("error_rate", "specwatch_error_ratio",
     "Errors and timeouts per finished request, newest window"),
    ("kv_peak", "specwatch_kv_usage_peak_ratio", "Peak KV-cache usage, newest window"),
    ("window_end", "specwatch_window_end_timestamp_seconds",
     "Event time the newest window of the key ends at"),
)


class LatencyHistogram:
    """Cumulative-bucket histogram of durations in seconds, as Prometheus wants it.

    >>> h = LatencyHistogram((1.0, 5.0))
    >>> for s in (0.5, 2.0, 9.0): h.observe(s)
    >>> h.buckets(), h.count, h.sum
    ([('1.0', 1), ('5.0', 2), ('+Inf', 3)], 3, 11.5)
    """

    def __init__(self, bounds: tuple[float, ...] = _DEFAULT_BUCKETS) -> None:
        if list(bounds) != sorted(bounds) or not bounds:
            raise ValueError(f"histogram bounds must be a non-empty ascending sequence, got {bounds}")
        self.bounds = tuple(float(b) for b in bounds)
        self._counts = [0] * (len(self.bounds) + 1)
        self.count = 0
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        if not math.isfinite(seconds):
            return
        self._counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.count += 1
        self.sum += seconds

    def buckets(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, n in zip(self.bounds, self._counts):
            running += n
            out.append((str(bound), running))
        out.append(("+Inf", running + self._counts[-1]))
        return out


class MetricsView:
    """What stage 2 knows now, per key, with bounded label cardinality; decisions; latencies.

    >>> from specwatch.schemas.slice_stats import SliceStats
    >>> from specwatch.schemas import Policy
    >>> from specwatch.streams.merge import Stage2
    >>> from specwatch.streams.slice_batch import SliceBatch
    >>> stage = Stage2(Policy())
    >>> batch = SliceBatch("s", 0, 0)
    >>> for bucket in ("chat", "coding"):
    ...     batch.partials[("b", bucket, "main")] = SliceStats()
    ...     batch.partials[("b", bucket, "main")].add_round(4, 3)
    >>> outputs = stage.add(batch)
    >>> view = MetricsView(lambda: [stage], max_keys=1)
    >>> [(key, row["acceptance_length"]) for key, row, _, _ in view.rows()], view.keys_overflow
    ([(('b', 'chat', 'main'), 4.0)], 1)
    """

    def __init__(self, stages: Callable[[], Iterable[Stage2]] = tuple, max_keys: int = DEFAULT_MAX_KEYS,
                 max_workers: int = DEFAULT_MAX_WORKERS) -> None:
        if max_keys < 1 or max_workers < 1:
            raise ValueError(f"max_keys and max_workers must be >= 1, got {max_keys} and {max_workers}")
        self.stages = stages
        self.max_keys = max_keys
        self.max_workers = max_workers
        self.keys_overflow = 0
        self.decisions: Counter = Counter()  # (action, reason) -> decisions decided
        self.slice_close_delay = LatencyHistogram()
        self.decision_latency = LatencyHistogram()
        self.engine_last_seen: dict[str, float] = {}  # engine worker -> wall time of its newest record
        self.workers_dropped = 0

    def observe(self, output: SliceOutput, now: float | None = None) -> None:
        """Count one final slice's decisions; ``now`` (wall clock) also times how late it closed."""
        for action in output.actions:
            self.decisions[(action.decision.action, action.decision.reason)] += 1
        if now is not None:
            self.slice_close_delay.observe(now - output.slice_end)

    def rows(self) -> list[tuple[Scope, dict, FlagStore, int | None]]:
        """(key, newest window row, the stage's flags, the card's D) of the exported keys, sorted."""
        found = sorted(((key, monitor, stage) for stage in self.stages()
                        for key, monitor in list(stage.decider.monitors.items()) if monitor.history),
                       key=lambda item: (item[0][0], item[0][1] or "", item[0][2] or ""))
        self.keys_overflow = max(0, len(found) - self.max_keys)
        return [(key, monitor.history[-1][1].summary(), stage.decider.flags, stage.decider.draft_length(key[0]))
                for key, monitor, stage in found[:self.max_keys]]

    def published(self, decision_ts: float, now: float) -> None:
        """A decision reached the decisions topic at wall time ``now``."""
        self.decision_latency.observe(now - decision_ts)

    def engines_seen(self, seen: Mapping[str, float]) -> None:
        """Merge the newest wall time each engine worker was heard from."""
        last = self.engine_last_seen
        for worker, at in seen.items():
            if worker not in last and len(last) >= self.max_workers:
                self.workers_dropped += 1
                continue
            if at > last.get(worker, -math.inf):
                last[worker] = at


@dataclass
class ServiceHealth:
    """The service's own health at one instant; fields a pipeline does not have stay empty."""

    records_read: int = 0
    records_rejected: Mapping[str, int] = field(default_factory=dict)
    consumer_lag: Mapping[tuple[str, int], int] = field(default_factory=dict)
    watermark_delay: Mapping[tuple[str, int], float] = field(default_factory=dict)
    checkpoint_age: Mapping[tuple[str, int], float] = field(default_factory=dict)
    archive_spool_bytes: int | None = None
    decisions_published: int = 0
    decisions_outbox: int = 0
    ready: bool = True
    # metric name -> (help, label, label value -> count)
    extra_counters: Mapping[str, tuple[str, str, Mapping]] = field(default_factory=dict)


def _finite(value) -> bool:
    return value is not None and isinstance(value, (int, float)) and math.isfinite(value)


class MetricsCollector:
    """A prometheus-client collector reading a `MetricsView` and a `ServiceHealth` at scrape time.
    """

    def __init__(self, view: MetricsView, health: Callable[[], ServiceHealth], clock: Callable[[], float]) -> None:
        self.view = view
        self.health = health
        self.clock = clock

    def collect(self) -> Iterator:
        yield from self._per_key()
        yield from self._decisions()
        yield from self._service(self.health())

    def _per_key(self) -> Iterator:
        gauges = {field: GaugeMetricFamily(name, help_text, labels=_KEY_LABELS)
                  for field, name, help_text in _KEY_GAUGES}
        latency = {metric: GaugeMetricFamily(
            f"specwatch_{metric}_seconds", f"{metric.upper()} quantiles over the newest window",
            labels=(*_KEY_LABELS, "quantile")) for metric in ("ttft", "tpot", "e2e")}
        enabled = GaugeMetricFamily("specwatch_speculation_enabled",
                                    "1 while speculation is on for the key, 0 while it is off", labels=_KEY_LABELS)
        draft_length = GaugeMetricFamily("specwatch_draft_length_tokens",
                                         "Draft length D in force (a limit, or the bundle card's D)",
                                         labels=_KEY_LABELS)
        off = GaugeMetricFamily("specwatch_speculation_off", "1 per reason speculation is off for the key",
                                labels=(*_KEY_LABELS, "reason"))
        stages = GaugeMetricFamily("specwatch_admission_stage", "1 for the admission stage a bundle is in",
                                   labels=("bundle", "stage"))
        staged: set[str] = set()
        rows = self.view.rows()
        for (bundle, bucket, cohort), row, flags, card_draft_length in rows:
            labels = [bundle, bucket or _WHOLE, cohort or _WHOLE]  # names are never empty
            values = dict(row)
            values["acceptance_rate"] = ratio(row.get("accepted_tokens", 0), row.get("drafted_tokens", 0))
            values["window_end"] = row.get("ts")
            for name, family in gauges.items():
                if _finite(values.get(name)):
                    family.add_metric(labels, float(values[name]))
            for metric, family in latency.items():
                for q, suffix in _QUANTILES:
                    value = row.get(f"{metric}_{suffix}")
                    if _finite(value):
                        family.add_metric([*labels, str(q)], value / 1000.0)
            if bucket is not None:
                answer = flags.lookup(bundle, bucket, cohort or "")
                enabled.add_metric(labels, 1.0 if answer.enabled else 0.0)
                limit = answer.draft_limit if answer.draft_limit is not None else card_draft_length
                if answer.enabled and limit is not None:
                    draft_length.add_metric(labels, float(limit))
                for reason in sorted(set(answer.reasons)):
                    off.add_metric([*labels, reason], 1.0)
            if bundle not in staged:
                staged.add(bundle)
                stage = flags.admission(bundle)
                if stage is not None:
                    stages.add_metric([bundle, stage.stage], 1.0)
        yield from gauges.values()
        yield from latency.values()
        yield from (enabled, draft_length, off, stages)
        yield GaugeMetricFamily("specwatch_metric_keys", "Keys exported (bounded by the key cap)",
                                value=len(rows))
        yield GaugeMetricFamily("specwatch_metric_keys_overflow", "Keys beyond the key cap, not exported",
                                value=self.view.keys_overflow)

    def _decisions(self) -> Iterator:
        family = CounterMetricFamily("specwatch_decisions", "Decisions decided, by action and reason",
                                     labels=("action", "reason"))
        # Every pair from zero: a counter born at 1 shows no increase, and the first decision would not page.
        for action in get_args(Action):
            for reason in get_args(Reason):
                family.add_metric([action, reason], self.view.decisions.get((action, reason), 0))
        yield family

    def _service(self, health: ServiceHealth) -> Iterator:
        now = self.clock()
        yield CounterMetricFamily("specwatch_records_read", "Telemetry records read and folded",
                                  value=health.records_read)
        yield _by_label("specwatch_records_rejected", "Telemetry records rejected, by reason",
                        "reason", health.records_rejected)
        yield _by_partition("specwatch_consumer_lag_messages", "Messages not yet folded, per partition",
                            ("topic", "partition"), health.consumer_lag)
        yield _by_partition("specwatch_watermark_delay_seconds", "Wall time minus the event time a telemetry "
                            "partition has closed slices up to", ("topic", "partition"), health.watermark_delay)
        yield _by_partition("specwatch_checkpoint_age_seconds", "Seconds since the task's last checkpoint",
                            ("stage", "partition"), health.checkpoint_age)
        for name, help_text, histogram in (
                ("specwatch_slice_close_delay_seconds", "Wall time a slice was decided at, minus its end",
                 self.view.slice_close_delay),
                ("specwatch_decision_latency_seconds", "Wall time a decision reached the decisions topic, "
                 "minus the event time that tipped it", self.view.decision_latency)):
            yield HistogramMetricFamily(name, help_text, buckets=histogram.buckets(), sum_value=histogram.sum)
        if health.archive_spool_bytes is not None:
            yield GaugeMetricFamily("specwatch_archive_spool_bytes", "Archive rows waiting on local disk",
                                    value=health.archive_spool_bytes)
        yield CounterMetricFamily("specwatch_decisions_published", "Decisions the decisions topic acknowledged",
                                  value=health.decisions_published)
        yield GaugeMetricFamily("specwatch_decisions_outbox", "Decisions decided and not yet acknowledged by the "
                                "decisions topic", value=health.decisions_outbox)
        ages = GaugeMetricFamily("specwatch_engine_heartbeat_age_seconds",
                                 "Seconds since the newest record of each engine worker", labels=("worker",))
        for worker, at in sorted(self.view.engine_last_seen.items()):
            ages.add_metric([worker], max(0.0, now - at))
        yield ages
        yield CounterMetricFamily("specwatch_engine_workers_dropped", "Records of engine workers beyond the "
                                  "worker cap, not tracked", value=self.view.workers_dropped)
        yield GaugeMetricFamily("specwatch_ready", "1 when the worker serves its partitions", value=float(health.ready))
        for name, (help_text, label, values) in sorted(health.extra_counters.items()):
            yield _by_label(name, help_text, label, values)


def _by_label(name: str, help_text: str, label: str, counts: Mapping) -> CounterMetricFamily:
    family = CounterMetricFamily(name, help_text, labels=(label,))
    for value, n in sorted(counts.items()):
        family.add_metric([str(value)], n)
    return family


def _by_partition(name: str, help_text: str, labels: tuple[str, str], values: Mapping) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, help_text, labels=labels)
    for (first, partition), value in sorted(values.items()):
        family.add_metric([first, str(partition)], float(value))
    return family

