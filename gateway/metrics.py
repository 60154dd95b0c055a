"""The gateway's own Prometheus metrics: requests by pool and routing reason, retries, upstream
failures, shadow checks, telemetry, and each pool's scraped spec-decode counters; rendered at scrape time."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .scrape import ServerCounters

__all__ = ["GatewayMetrics"]


class GatewayMetrics:
    """Plain counters the proxy bumps, turned into metric families only when scraped.

    >>> metrics = GatewayMetrics()
    >>> metrics.count("requests", ("/v1/completions", "speculative", "speculating"))
    >>> b"specwatch_gateway_requests_total" in metrics.render()
    True
    """

    # name -> (help, labels)
    _FAMILIES = {
        "requests": ("Requests the gateway routed, by route, pool and routing reason", ("route", "pool", "reason")),
        "retries": ("Requests retried on the standard pool after the speculative pool failed before any token",
                    ("cause",)),
        "upstream_failures": ("Attempts a pool failed (error or timeout), retried or not", ("pool", "kind")),
        "responses": ("Responses sent to clients, by pool and status class", ("pool", "status")),
        "rejected": ("Requests refused by the gateway itself, by reason", ("reason",)),
        "shadow_checks": ("Mirrored requests compared with the standard answer", ("outcome",)),
        "telemetry_records": ("Contract records handed to the telemetry sink, by kind", ("kind",)),
        "telemetry_errors": ("Records the telemetry sink refused or that failed validation", ("kind",)),
        "scrape_errors": ("Failed scrapes of a pool's /metrics or card", ("pool",)),
    }

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, Counter] = {name: Counter() for name in self._FAMILIES}
        self.pools: dict[str, ServerCounters] = {}
        self.pool_up: dict[str, bool] = {}
        # mirrored copies not compared yet, read at scrape time (the gateway counts its own)
        self.shadow_in_flight: Callable[[], int] = lambda: 0
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def count(self, family: str, labels: tuple[str, ...], n: int = 1) -> None:
        with self._lock:
            self._counts[family][labels] += n

    def value(self, family: str, labels: tuple[str, ...] | None = None) -> int:
        """One counter (or a family's total without ``labels``): what tests and reports read."""
        with self._lock:
            counts = self._counts[family]
            return counts[labels] if labels is not None else sum(counts.values())

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterator:
        with self._lock:
            snapshot = {name: dict(counts) for name, counts in self._counts.items()}
        for name, (help_text, labels) in self._FAMILIES.items():
            family = CounterMetricFamily(f"specwatch_gateway_{name}", help_text, labels=labels)
            for values, n in sorted(snapshot[name].items()):
                family.add_metric(list(values), n)
            yield family
        up = GaugeMetricFamily("specwatch_gateway_pool_up", "1 when the pool's /metrics answered at the last scrape",
                               labels=("pool",))
        for pool, is_up in sorted(self.pool_up.items()):
            up.add_metric([pool], 1.0 if is_up else 0.0)
        yield up
        yield GaugeMetricFamily("specwatch_gateway_shadow_in_flight", "Shadow copies sent to the speculative "
                                "pool and not compared with the standard answer yet", value=self.shadow_in_flight())
        drafts = CounterMetricFamily("specwatch_gateway_pool_spec_drafts", "Verify steps that drafted, as the "
                                     "pool's server counts them (scraped)", labels=("pool",))
        drafted = CounterMetricFamily("specwatch_gateway_pool_spec_draft_tokens", "Draft tokens proposed, as "
                                      "the pool's server counts them (scraped)", labels=("pool",))
        accepted = CounterMetricFamily("specwatch_gateway_pool_spec_accepted_tokens", "Draft tokens accepted, as "
                                       "the pool's server counts them (scraped)", labels=("pool",))
        per_position = CounterMetricFamily("specwatch_gateway_pool_spec_accepted_per_position",
                                           "Draft tokens accepted at each draft position (scraped)",
                                           labels=("pool", "position"))
        kv = GaugeMetricFamily("specwatch_gateway_pool_kv_usage_ratio", "The pool's KV-cache usage (scraped)",
                               labels=("pool",))
        for pool, counters in sorted(self.pools.items()):
            if counters.speculative:
                drafts.add_metric([pool], counters.drafts)
                drafted.add_metric([pool], counters.draft_tokens)
                accepted.add_metric([pool], counters.accepted_tokens)
                for position, n in enumerate(counters.accepted_per_position):
                    per_position.add_metric([pool, str(position)], n)
            if counters.kv_usage is not None:
                kv.add_metric([pool], counters.kv_usage)
        yield from (drafts, drafted, accepted, per_position, kv)
