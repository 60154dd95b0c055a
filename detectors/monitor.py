"""Per-key monitors: rolling windows over slices, baselines, and the gates of the fallback table.

A `KeyMonitor` watches one (bundle, bucket, cohort); a `BundleMonitor` watches the
step-level signals of a whole bundle (KV, draft cost). Both return `Finding`s; the action
policy decides what to do with them. Pure code: no clocks, no I/O.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from specwatch.schemas.policy import Policy

from .baseline import Baseline, BaselineLearner
from .gates import ConsecutiveGate, DropDetector
from .window import SliceStats, merge_all

__all__ = ["Finding", "KeyMonitor", "BundleMonitor"]


@dataclass(frozen=True)
class Finding:
    """A detector's verdict that something on the fallback table happened."""

    reason: str
    detector: str
    ts: float
    metric: str
    value: float
    threshold: float
    baseline: float
    window_start: float
    window_end: float
    details: dict = field(default_factory=dict)

    def evidence(self) -> dict:
        out = {
            "metric": self.metric,
            "value": _round(self.value),
            "threshold": _round(self.threshold),
            "baseline": _round(self.baseline),
            "window_start": _round(self.window_start),
            "window_end": _round(self.window_end),
        }
        out.update({k: _round(v) for k, v in self.details.items()})
        return out


def _round(value):
    """Six significant digits: evidence reads the same however partials were grouped."""
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return None
        return float(f"{value:.6g}")
    if isinstance(value, list):
        return [_round(v) for v in value]
    return value


class _Windowed:
    """A bounded history of slices for one key, with window merges on demand."""

    def __init__(self, size: int) -> None:
        self.history: deque[tuple[float, SliceStats]] = deque(maxlen=size)

    def push(self, slice_end: float, stats: SliceStats) -> None:
        self.history.append((slice_end, stats))

    def window(self, slices: int) -> tuple[SliceStats, float, float]:
        recent = list(self.history)[-slices:]
        return merge_all(s for _, s in recent), recent[0][0], recent[-1][0]

    def evidence_window(self, slices: int) -> list[dict]:
        return [dict(s.summary(), slice_end=end) for end, s in list(self.history)[-slices:]]


class KeyMonitor(_Windowed):
    """Acceptance, speedup, latency and error gates for one (bundle, bucket, cohort).

    Parameters
    ----------
    policy
        The policy the gates are tuned by.
    bucket
        Used to look up a pinned baseline for this bucket.
    """

    def __init__(self, policy: Policy, bucket: str) -> None:
        self.policy = policy
        self.bucket = bucket
        p = policy
        super().__init__(max(p.latency.window_slices, p.errors.window_slices, p.acceptance.window_slices,
                             p.speedup.window_slices, 30))
        self.learner = BaselineLearner(p.baseline, p.baseline.pinned.get(bucket))
        self._reset()

    def _reset(self) -> None:
        p = self.policy
        self.acceptance_gate = ConsecutiveGate(p.acceptance.consecutive)
        self.acceptance_drift = DropDetector(min_drop=p.acceptance.tolerance)
        self.speedup_gate = ConsecutiveGate(p.speedup.consecutive)
        self.latency_gate = ConsecutiveGate(p.latency.consecutive)
        self.error_gate = ConsecutiveGate(p.errors.consecutive)
        self._slices_seen = 0

    @property
    def baseline(self) -> Baseline:
        return self.learner.baseline

    def rearm(self) -> None:
        """Forget streaks after an action changed the path (new D, fallback, restore)."""
        self._reset()

    def update(self, stats: SliceStats, slice_end: float, speculating: bool = True) -> list[Finding]:
        self.push(slice_end, stats)
        self._slices_seen += 1
        if not self.learner.done:
            self.learner.update(stats, slice_end)
        findings: list[Finding] = []
        if speculating:
            findings += self._acceptance(stats.max_ts)
            findings += self._speedup(stats.max_ts)
        evaluate_requests = self._slices_seen % self.policy.latency.evaluate_every_slices == 0
        if evaluate_requests and speculating:
            findings += self._latency(stats.max_ts)
        if evaluate_requests and speculating:
            findings += self._errors(stats.max_ts)
        return findings

    # -- acceptance length against the learned per-position rates ------------------------
    def _acceptance(self, ts: float) -> list[Finding]:
        cfg = self.policy.acceptance
        if not self.learner.acceptance_ready:
            return []
        window, start, end = self.window(cfg.window_slices)
        if window.rounds < cfg.min_rounds:
            self.acceptance_gate.update(None)
            return []
        expected = self.baseline.expected_acceptance_length(window.drafted_at_least, window.rounds)
        if math.isnan(expected):
            return []
        observed = window.acceptance_length
        relative = observed / expected
        threshold = 1.0 - cfg.tolerance
        self.acceptance_gate.update(relative < threshold)
        self.acceptance_drift.update(relative)
        detector = ("acceptance_gate" if self.acceptance_gate.drift_detected
                    else "acceptance_adwin" if self.acceptance_drift.drift_detected and relative < threshold
                    else None)
        if detector is None:
            return []
        return [Finding("acceptance_drop", detector, ts, "acceptance_length", observed, expected * threshold,
                        expected, start, end,
                        {"relative_to_baseline": relative, "rounds": window.rounds,
                         "mean_draft_length": window.drafted_tokens / window.rounds,
                         "consecutive": self.acceptance_gate.streak})]

    def _speedup(self, ts: float) -> list[Finding]:
        cfg = self.policy.speedup
        window, start, end = self.window(cfg.window_slices)
        if window.rounds < self.policy.acceptance.min_rounds or window.steps == 0:
            self.speedup_gate.update(None)
            return []
        speedup = window.speedup
        self.speedup_gate.update(speedup < cfg.min_speedup)
        if not self.speedup_gate.drift_detected:
            return []
        return [Finding("no_speedup", "speedup_gate", ts, "estimated_speedup", speedup, cfg.min_speedup,
                        math.nan, start, end,
                        {"acceptance_length": window.acceptance_length,
                         "draft_overhead": window.draft_overhead, "rounds": window.rounds})]

    def _latency(self, ts: float) -> list[Finding]:
        cfg = self.policy.latency
        window, start, end = self.window(cfg.window_slices)
        if window.requests < cfg.min_requests:
            self.latency_gate.update(None)
            return []
        checks = []
        for metric, slo, base in (("e2e", cfg.e2e_p99_slo_ms, self.baseline.e2e_p99_ms),
                                  ("tpot", cfg.tpot_p99_slo_ms, self.baseline.tpot_p99_ms)):
            p99 = window.quantile(metric, 0.99)
            limits = [x for x in (slo, base * cfg.p99_factor if not math.isnan(base) else None) if x]
            if limits and not math.isnan(p99):
                checks.append((p99 / min(limits), metric, p99, min(limits), base))
        if not checks:
            self.latency_gate.update(None)
            return []
        worst = max(checks)
        self.latency_gate.update(worst[0] > 1.0)
        if not self.latency_gate.drift_detected:
            return []
        _, metric, p99, limit, base = worst
        return [Finding("latency_slo", "latency_p99_gate", ts, f"{metric}_p99_ms", p99, limit, base, start, end,
                        {"requests": window.requests, f"{metric}_p50_ms": window.quantile(metric, 0.5),
                         f"{metric}_p95_ms": window.quantile(metric, 0.95)})]

    def _errors(self, ts: float) -> list[Finding]:
        cfg = self.policy.errors
        window, start, end = self.window(cfg.window_slices)
        failures = window.errors + window.timeouts
        if window.requests < cfg.min_requests:
            self.error_gate.update(None)
            return []
        base = self.baseline.error_rate
        limit = max(cfg.floor_rate, base * cfg.factor if not math.isnan(base) else cfg.floor_rate)
        rate = window.error_rate
        self.error_gate.update(rate > limit and failures >= cfg.min_errors)
        if not self.error_gate.drift_detected:
            return []
        return [Finding("error_rate", "error_rate_gate", ts, "error_rate", rate, limit, base, start, end,
                        {"requests": window.requests, "errors": window.errors, "timeouts": window.timeouts})]


class BundleMonitor(_Windowed):
    """Step-level gates for a whole bundle: KV watermark and draft cost.

    KV usage and draft time belong to engine steps, which mix every bucket; judging
    them per bundle gives one decision for a fleet-wide condition instead of one per key.
    """

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        super().__init__(max(policy.draft_overhead.window_slices, 30))
        self.learner = BaselineLearner(policy.baseline, None)
        self._reset()

    def _reset(self) -> None:
        self.kv_gate = ConsecutiveGate(self.policy.kv.consecutive)
        self.draft_gate = ConsecutiveGate(self.policy.draft_overhead.consecutive)

    @property
    def baseline(self) -> Baseline:
        return self.learner.baseline

    def rearm(self) -> None:
        self._reset()

    def update(self, stats: SliceStats, slice_end: float, speculating: bool = True) -> list[Finding]:
        self.push(slice_end, stats)
        if not self.learner.done:
            self.learner.update(stats, slice_end)
        findings: list[Finding] = []
        if stats.steps == 0:
            return findings
        kv = self.policy.kv
        self.kv_gate.update(stats.kv_peak > kv.watermark if speculating else None)
        if self.kv_gate.drift_detected:
            findings.append(Finding("kv_pressure", "kv_watermark_gate", stats.max_ts, "kv_peak", stats.kv_peak,
                                    kv.watermark, math.nan, slice_end - kv.consecutive * 1.0, slice_end,
                                    {"consecutive": self.kv_gate.streak}))
        cfg = self.policy.draft_overhead
        base = self.baseline.draft_to_verify
        window, start, end = self.window(cfg.window_slices)
        if speculating and self.learner.acceptance_ready and not math.isnan(base) and window.rounds:
            value = window.draft_to_verify
            self.draft_gate.update(value > base * cfg.factor)
            if self.draft_gate.drift_detected:
                findings.append(Finding("draft_overhead", "draft_cost_gate", stats.max_ts, "draft_to_verify",
                                        value, base * cfg.factor, base, start, end,
                                        {"draft_overhead": window.draft_overhead,
                                         "draft_ms_per_step": window.draft_ms / window.steps,
                                         "speedup": window.speedup}))
        return findings
