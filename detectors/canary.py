"""The canary judge: one bucket's speculative cohort against its standard-decoding baseline.

Rank-based like Kayenta's judge: per-window samples of each metric on both sides, a one-sided
Mann-Whitney test for "the canary is worse", a tolerance for effects too small to matter,
and minimum sample counts before any verdict. Pure code: no clocks, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from scipy.stats import binom, mannwhitneyu

from specwatch.schemas.policy import AdmissionPolicy

from .window import SliceStats, ratio

__all__ = ["CanaryJudge", "Judgement", "MetricVerdict", "WindowSample", "mann_whitney_greater", "combine"]

Outcome = Literal["pass", "marginal", "fail"]

# Lower is better for every latency; the tail quantiles are what a mean tok/s hides.
_LATENCY_METRICS = (("ttft", 0.95), ("ttft", 0.99), ("tpot", 0.95), ("tpot", 0.99), ("e2e", 0.99))
_RANK = {"pass": 0, "marginal": 1, "fail": 2}


def mann_whitney_greater(x, y) -> float:
    """One-sided Mann-Whitney U p-value for "values of ``x`` tend to exceed those of ``y``".

    Always the normal approximation with tie correction (and continuity correction):
    scipy's default switches to the exact distribution for small samples without ties,
    which would make a verdict's meaning depend on whether two windows happened to tie.

    >>> round(mann_whitney_greater([5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6]), 4)
    0.0064
    >>> round(mann_whitney_greater([1, 2, 3, 4], [1, 2, 3, 4]), 3)
    0.559
    >>> math.isnan(mann_whitney_greater([], [1.0]))
    True
    """
    x = [v for v in x if not math.isnan(v)]
    y = [v for v in y if not math.isnan(v)]
    if not x or not y:
        return math.nan
    if len(set(x) | set(y)) == 1:
        return 1.0  # every value tied: no evidence either way (scipy would divide by zero)
    return float(mannwhitneyu(x, y, alternative="greater", method="asymptotic", use_continuity=True).pvalue)


@dataclass(frozen=True)
class WindowSample:
    """One judge window of one side, read as the metrics the judge compares."""

    requests: int
    errors: int
    speedup: float
    acceptance_length: float
    error_rate: float
    kv_peak: float
    latency: dict = field(default_factory=dict)  # "tpot_p99" -> ms

    @classmethod
    def from_stats(cls, stats: SliceStats) -> "WindowSample":
        latency = {f"{metric}_p{round(q * 100)}": stats.quantile(metric, q) for metric, q in _LATENCY_METRICS}
        return cls(stats.requests, stats.errors + stats.timeouts, stats.speedup if stats.steps else math.nan,
                   stats.acceptance_length, stats.error_rate, stats.kv_peak if stats.steps else math.nan, latency)


@dataclass(frozen=True)
class MetricVerdict:
    """The verdict on one metric: medians of the windows on each side, the limit, the test."""

    metric: str
    outcome: Outcome
    canary: float
    baseline: float
    limit: float
    p_value: float = math.nan
    windows: tuple[int, int] = (0, 0)
    note: str = ""

    def evidence(self) -> dict:
        out = {"metric": self.metric, "outcome": self.outcome, "canary": _round(self.canary),
               "baseline": _round(self.baseline), "limit": _round(self.limit),
               "p_value": _round(self.p_value), "windows": list(self.windows)}
        if self.note:
            out["note"] = self.note
        return out


@dataclass(frozen=True)
class Judgement:
    """A bucket's verdict: the worst of its metrics, with the per-metric breakdown."""

    outcome: Outcome
    metrics: tuple[MetricVerdict, ...]
    canary_requests: int
    baseline_requests: int
    shadow_checks: int
    shadow_mismatches: int

    @property
    def failing(self) -> list[MetricVerdict]:
        return [m for m in self.metrics if m.outcome == "fail"]

    @property
    def waiting(self) -> list[MetricVerdict]:
        return [m for m in self.metrics if m.outcome == "marginal"]

    def evidence(self) -> dict:
        return {"outcome": self.outcome, "canary_requests": self.canary_requests,
                "baseline_requests": self.baseline_requests, "shadow_checks": self.shadow_checks,
                "shadow_mismatches": self.shadow_mismatches, "metrics": [m.evidence() for m in self.metrics]}


def combine(outcomes) -> Outcome:
    """The worst of several outcomes; ``pass`` for none.

    >>> combine(["pass", "marginal", "pass"]), combine(["marginal", "fail"]), combine([])
    ('marginal', 'fail', 'pass')
    """
    return max(outcomes, key=_RANK.__getitem__, default="pass")


class _Side:
    """One side's slices folded into windows of equal request counts."""

    def __init__(self, window_requests: int) -> None:
        self.window_requests = window_requests
        self.pending = SliceStats()
        self.windows: list[WindowSample] = []
        self.requests = 0

    def update(self, stats: SliceStats) -> None:
        self.pending.merge(stats)
        self.requests += stats.requests
        if self.pending.requests >= self.window_requests:
            self.windows.append(WindowSample.from_stats(self.pending))
            self.pending = SliceStats()


class CanaryJudge:
    """Judges one (bundle, bucket) at one stage: the speculating cohort against the baseline.

    Feed it each final slice of either side with ``update(side, stats)`` and every shadow
    check of the bucket with ``add_shadow``; read ``judgement``. Each side's slices are cut
    into windows of ``window_requests`` finished requests, so a window's p99 is a quantile
    of the same number of requests on both sides, whatever their traffic shares.

    Metrics: estimated speedup (the canary alone, against ``min_speedup``, by a sign test);
    TTFT p95/p99, TPOT p95/p99 and e2e p99, error rate and KV peak (canary against
    baseline, one-sided Mann-Whitney); strict shadow mismatches (one is a fail). A metric
    fails when the canary's median is past its limit *and* the test is significant; past
    the limit without significance, or with fewer than ``min_windows`` windows, it is
    marginal: wait for more data.

    Parameters
    ----------
    policy
        The admission settings (window size, minimum windows, confidence, tolerances).
    strict_checks
        Shadow checks whose single mismatch breaks the lossless contract.
    require_shadow_checks
        In the shadow stage the mirrored traffic must also show ``min_shadow_checks`` checks.

    >>> from specwatch.schemas.policy import AdmissionPolicy
    >>> policy = AdmissionPolicy(window_requests=4, min_windows=3)
    >>> judge = CanaryJudge(policy, ["token_exact"])
    >>> def slice_of(tpot, n=4, speculative=True):
    ...     s = SliceStats()
    ...     for i in range(n):
    ...         s.add_request(50.0, tpot + i, 50.0 + 100 * (tpot + i), speculative, "stop", 1.0)
    ...     if speculative:
    ...         s.add_round(4, 3)
    ...     s.add_step_time(1.0 if speculative else 0.0, 10.0, 0.5, 1.0)
    ...     return s
    >>> for _ in range(5):
    ...     judge.update("baseline", slice_of(12.0, speculative=False)); judge.update("canary", slice_of(6.0))
    >>> judge.judgement.outcome
    'pass'
    >>> judge = CanaryJudge(policy, ["token_exact"])  # the next stage starts afresh
    >>> for _ in range(6):
    ...     judge.update("baseline", slice_of(12.0, speculative=False)); judge.update("canary", slice_of(30.0))
    >>> verdict = judge.judgement
    >>> verdict.outcome, [m.metric for m in verdict.failing]
    ('fail', ['tpot_p95', 'tpot_p99', 'e2e_p99'])
    >>> judge.add_shadow(False, "token_exact", "r9", 2.0)
    >>> judge.judgement.metrics[-1].evidence()["note"]
    'strict mismatch r9 (token_exact) at 2.0'
    """

    def __init__(self, policy: AdmissionPolicy, strict_checks, require_shadow_checks: bool = False) -> None:
        self.policy = policy
        self.strict_checks = frozenset(strict_checks)
        self.require_shadow_checks = require_shadow_checks
        self._reset()

    def _reset(self) -> None:
        self.canary = _Side(self.policy.window_requests)
        self.baseline = _Side(self.policy.window_requests)
        self.shadow_checks = 0
        self.mismatches: list[tuple[float, str, str]] = []
        self._judgement: Judgement | None = None

    def update(self, side: Literal["canary", "baseline"], stats: SliceStats) -> None:
        if side not in ("canary", "baseline"):
            raise ValueError(f"side must be 'canary' or 'baseline', got {side!r}")
        (self.canary if side == "canary" else self.baseline).update(stats)
        self._judgement = None

    def add_shadow(self, match: bool, check: str, request_id: str, ts: float) -> None:
        """One shadow check of the speculating cohort's output against standard decoding."""
        if check not in self.strict_checks:
            return
        self.shadow_checks += 1
        if not match:
            self.mismatches.append((ts, request_id, check))
        self._judgement = None

    @property
    def mismatched(self) -> bool:
        return bool(self.mismatches)

    @property
    def judgement(self) -> Judgement:
        if self._judgement is None:
            self._judgement = self._judge()
        return self._judgement

    def _judge(self) -> Judgement:
        cw, bw = self.canary.windows, self.baseline.windows
        metrics = [self._speedup(cw)]
        for metric, q in _LATENCY_METRICS:
            name = f"{metric}_p{round(q * 100)}"
            metrics.append(self._compare(name, [w.latency[name] for w in cw], [w.latency[name] for w in bw],
                                         lambda base: base * (1.0 + self.policy.latency_tolerance)))
        canary_rate = ratio(sum(w.errors for w in cw), sum(w.requests for w in cw))
        baseline_rate = ratio(sum(w.errors for w in bw), sum(w.requests for w in bw))
        metrics.append(self._compare("error_rate", [w.error_rate for w in cw], [w.error_rate for w in bw],
                                     lambda base: base + self.policy.error_tolerance,
                                     pooled=(canary_rate, baseline_rate)))
        metrics.append(self._compare("kv_peak", [w.kv_peak for w in cw], [w.kv_peak for w in bw],
                                     lambda base: base + self.policy.kv_tolerance))
        metrics.append(self._quality())
        return Judgement(combine(m.outcome for m in metrics), tuple(metrics), self.canary.requests,
                         self.baseline.requests, self.shadow_checks, len(self.mismatches))

    def _enough(self, n: int) -> bool:
        return n >= self.policy.min_windows

    def _alpha(self) -> float:
        return 1.0 - self.policy.confidence

    def _speedup(self, windows: list[WindowSample]) -> MetricVerdict:
        values = [w.speedup for w in windows if not math.isnan(w.speedup)]
        floor = self.policy.min_speedup
        median = _median(values)
        al = _median([w.acceptance_length for w in windows if not math.isnan(w.acceptance_length)])
        note = f"acceptance length {al:.3g}" if not math.isnan(al) else ""
        if not self._enough(len(values)):
            return MetricVerdict("estimated_speedup", "marginal", median, math.nan, floor, math.nan,
                                 (len(values), 0), _join("insufficient windows", note))
        if median >= floor:
            return MetricVerdict("estimated_speedup", "pass", median, math.nan, floor, math.nan,
                                 (len(values), 0), note)
        # Sign test: are windows below the floor more often than a coin would put them there?
        below = sum(v < floor for v in values)
        p = float(binom.sf(below - 1, len(values), 0.5))
        outcome = "fail" if p < self._alpha() else "marginal"
        return MetricVerdict("estimated_speedup", outcome, median, math.nan, floor, p, (len(values), 0), note)

    def _compare(self, name: str, canary: list[float], baseline: list[float], limit_of,
                 pooled: tuple[float, float] | None = None) -> MetricVerdict:
        canary = [v for v in canary if not math.isnan(v)]
        baseline = [v for v in baseline if not math.isnan(v)]
        windows = (len(canary), len(baseline))
        observed, base = pooled if pooled is not None else (_median(canary), _median(baseline))
        limit = limit_of(base) if not math.isnan(base) else math.nan
        if not (self._enough(len(canary)) and self._enough(len(baseline))):
            return MetricVerdict(name, "marginal", observed, base, limit, math.nan, windows, "insufficient windows")
        p = mann_whitney_greater(canary, baseline)
        if not observed > limit:
            return MetricVerdict(name, "pass", observed, base, limit, p, windows)
        outcome = "fail" if p < self._alpha() else "marginal"
        return MetricVerdict(name, outcome, observed, base, limit, p, windows,
                             "" if outcome == "fail" else "above the limit, not yet significant")

    def _quality(self) -> MetricVerdict:
        checks, mismatched = self.shadow_checks, len(self.mismatches)
        if mismatched:
            ts, request_id, check = self.mismatches[0]
            return MetricVerdict("shadow_mismatches", "fail", float(mismatched), 0.0, 0.0, math.nan, (checks, 0),
                                 f"strict mismatch {request_id} ({check}) at {ts}")
        if self.require_shadow_checks and checks < self.policy.min_shadow_checks:
            return MetricVerdict("shadow_mismatches", "marginal", 0.0, 0.0, 0.0, math.nan, (checks, 0),
                                 f"{checks} of {self.policy.min_shadow_checks} shadow checks")
        return MetricVerdict("shadow_mismatches", "pass", 0.0, 0.0, 0.0, math.nan, (checks, 0))


def _median(values: list[float]) -> float:
    return float(np.median(values)) if values else math.nan


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def _round(value):
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return None
        return float(f"{value:.6g}")
    return value
