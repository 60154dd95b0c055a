"""The canary judge: one bucket's speculative cohort against its standard-decoding baseline,
rank-based like Kayenta's judge; docs/ADMISSION.md has the tests and their alpha."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from specwatch.schemas.policy import AdmissionPolicy

from specwatch.schemas.latency_sketch import LatencySketch
from specwatch.schemas.slice_stats import SliceStats, round_evidence as _round

__all__ = ["CanaryJudge", "Judgement", "MetricVerdict", "WindowSample", "mann_whitney_greater", "combine"]

Outcome = Literal["pass", "marginal", "fail"]

# Lower is better for every latency; the tail quantiles are what a mean tok/s hides.
_LATENCY_METRICS = (("ttft", 0.95), ("ttft", 0.99), ("tpot", 0.95), ("tpot", 0.99), ("e2e", 0.99))
_RANK = {"pass": 0, "marginal": 1, "fail": 2}
_COMPARISONS = len(_LATENCY_METRICS) + 2  # latencies, error rate, KV peak against the baseline


def mann_whitney_greater(x, y) -> float:
    """One-sided Mann-Whitney U p-value for "values of ``x`` tend to exceed those of ``y``", always
    by the normal approximation, so a verdict's meaning never depends on whether two windows tied.

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
    from scipy.stats import mannwhitneyu  # only a judged bundle pays scipy's import

    return float(mannwhitneyu(x, y, alternative="greater", method="asymptotic", use_continuity=True).pvalue)


def _binomial_sf(k: int, n: int, p: float) -> float:
    """P(X > k) for X ~ Binomial(n, p)."""
    from scipy.stats import binom  # only a judged bundle pays scipy's import

    return float(binom.sf(k, n, p))


@dataclass(frozen=True)
class WindowSample:
    """One judge window of one side, read as the metrics the judge compares."""

    requests: int
    errors: int
    speedup: float
    acceptance_length: float
    error_rate: float
    kv_peak: float
    sketches: dict = field(default_factory=dict)  # "tpot" -> the window's LatencySketch

    @classmethod
    def from_stats(cls, stats: SliceStats) -> "WindowSample":
        sketches = {m: getattr(stats, m) for m in ("ttft", "tpot", "e2e") if getattr(stats, m) is not None}
        return cls(stats.requests, stats.errors + stats.timeouts, stats.speedup if stats.steps else math.nan,
                   stats.acceptance_length, stats.error_rate, stats.kv_peak if stats.steps else math.nan, sketches)

    def to_state(self) -> dict:
        return {"requests": self.requests, "errors": self.errors, "speedup": self.speedup,
                "acceptance_length": self.acceptance_length, "error_rate": self.error_rate,
                "kv_peak": self.kv_peak, "sketches": {m: s.to_state() for m, s in self.sketches.items()}}

    @classmethod
    def from_state(cls, state: dict) -> "WindowSample":
        return cls(int(state["requests"]), int(state["errors"]), float(state["speedup"]),
                   float(state["acceptance_length"]), float(state["error_rate"]), float(state["kv_peak"]),
                   {str(m): LatencySketch.from_state(s) for m, s in state["sketches"].items()})

    def share_above(self, metric: str, limit: float) -> float:
        """Share of the window's requests whose ``metric`` is above ``limit``; NaN without any."""
        sketch = self.sketches.get(metric)
        if sketch is None or not sketch.count or math.isnan(limit):
            return math.nan
        return sketch.count_above(limit) / sketch.count


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

    def to_state(self) -> dict:
        return {"metric": self.metric, "outcome": self.outcome, "canary": self.canary, "baseline": self.baseline,
                "limit": self.limit, "p_value": self.p_value, "windows": list(self.windows), "note": self.note}

    @classmethod
    def from_state(cls, state: dict) -> "MetricVerdict":
        if state["outcome"] not in _RANK:
            raise ValueError(f"unknown outcome {state['outcome']!r}")
        return cls(str(state["metric"]), state["outcome"], float(state["canary"]), float(state["baseline"]),
                   float(state["limit"]), float(state["p_value"]),
                   (int(state["windows"][0]), int(state["windows"][1])), str(state["note"]))

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


class ComparedSide:
    """One side's slices folded into windows of equal request counts."""

    def __init__(self, window_requests: int) -> None:
        self.window_requests = window_requests
        self.pending = SliceStats()
        self.closed = SliceStats()  # every closed window pooled
        self.windows: list[WindowSample] = []

    @property
    def requests(self) -> int:
        return self.closed.requests + self.pending.requests

    def to_state(self) -> dict:
        return {"pending": self.pending.to_state(), "closed": self.closed.to_state(),
                "windows": [w.to_state() for w in self.windows]}

    def load_state(self, state: dict) -> None:
        self.pending = SliceStats.from_state(state["pending"])
        self.closed = SliceStats.from_state(state["closed"])
        self.windows = [WindowSample.from_state(w) for w in state["windows"]]

    def update(self, stats: SliceStats) -> bool:
        """Fold one slice in; True when it closed a window."""
        self.pending.merge(stats)
        if self.pending.requests < self.window_requests:
            return False
        self.windows.append(WindowSample.from_stats(self.pending))
        self.closed.merge(self.pending)
        self.pending = SliceStats()
        return True


class CanaryJudge:
    """Judges one (bundle, bucket) at one stage: the speculating cohort against the baseline.

    Feed it each final slice of either side with ``update(side, stats)`` and every shadow
    check with ``add_shadow``; read ``judgement``. Each side is cut into windows of
    ``window_requests`` finished requests; docs/ADMISSION.md lists the metrics and tests.

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
    >>> for _ in range(12):  # the third look (3, 6, 12 windows a side) spends enough alpha for this
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
        self.canary = ComparedSide(self.policy.window_requests)
        self.baseline = ComparedSide(self.policy.window_requests)
        self.shadow_checks = 0
        self.mismatches: list[tuple[float, str, str]] = []
        self.version = 0  # counts windows closed and checks seen: time-based rules are read again
        self._judgement: Judgement | None = None
        self._tested_look = 0  # the scheduled look the tests last ran at
        self._extra_looks = 0  # looks taken off the schedule, before a promotion (``confirm``)
        self._tested_windows = (0, 0)
        self._tests = self._test()

    def to_state(self) -> dict:
        """The evidence and the verdict standing on it, as plain data (the settings are the owner's)."""
        return {"canary": self.canary.to_state(), "baseline": self.baseline.to_state(),
                "shadow_checks": self.shadow_checks, "mismatches": [list(m) for m in self.mismatches],
                "version": self.version, "tested_look": self._tested_look, "extra_looks": self._extra_looks,
                "tested_windows": list(self._tested_windows), "tests": [t.to_state() for t in self._tests]}

    def load_state(self, state: dict) -> None:
        self.canary.load_state(state["canary"])
        self.baseline.load_state(state["baseline"])
        self.shadow_checks = int(state["shadow_checks"])
        self.mismatches = [(float(ts), str(rid), str(check)) for ts, rid, check in state["mismatches"]]
        self.version = int(state["version"])
        self._tested_look, self._extra_looks = int(state["tested_look"]), int(state["extra_looks"])
        self._tested_windows = (int(state["tested_windows"][0]), int(state["tested_windows"][1]))
        self._tests = tuple(MetricVerdict.from_state(t) for t in state["tests"])
        self._judgement = None  # read again from the tests on demand

    def update(self, side: Literal["canary", "baseline"], stats: SliceStats) -> None:
        if side not in ("canary", "baseline"):
            raise ValueError(f"side must be 'canary' or 'baseline', got {side!r}")
        if (self.canary if side == "canary" else self.baseline).update(stats):
            self.version += 1
            if self.look != self._tested_look:  # the verdict stands until the next look
                self._tested_look = self.look
                self._retest()

    def confirm(self) -> None:
        """Look once more, off the schedule, at windows that grew since the last look (before a
        promotion); it takes the next look's share of alpha."""
        if self._tested_look and self._windows() != self._tested_windows:
            self._extra_looks += 1
            self._retest()

    def _windows(self) -> tuple[int, int]:
        return len(self.canary.windows), len(self.baseline.windows)

    def _retest(self) -> None:
        self._tested_windows = self._windows()
        self._tests = self._test()
        self._judgement = None

    def add_shadow(self, match: bool, check: str, request_id: str, ts: float) -> None:
        """One shadow check of the speculating cohort's output against standard decoding."""
        if check not in self.strict_checks:
            return
        self.shadow_checks += 1
        if not match:
            self.mismatches.append((ts, request_id, check))
        self.version += 1
        self._judgement = None

    @property
    def judgement(self) -> Judgement:
        if self._judgement is None:
            metrics = (*self._tests, self._quality())
            self._judgement = Judgement(combine(m.outcome for m in metrics), metrics, self.canary.requests,
                                        self.baseline.requests, self.shadow_checks, len(self.mismatches))
        return self._judgement

    def _test(self) -> tuple[MetricVerdict, ...]:
        """The statistical tests on the closed windows, at this look's alpha."""
        cw, bw = self.canary.windows, self.baseline.windows
        metrics = [self._speedup(cw)]
        # tails are tested on each window's share past the limit: per-window p99s would hide them
        canary_pool, baseline_pool = self.canary.closed, self.baseline.closed
        for metric, q in _LATENCY_METRICS:
            observed, base = canary_pool.quantile(metric, q), baseline_pool.quantile(metric, q)
            limit = base * (1.0 + self.policy.latency_tolerance)
            sketch = getattr(canary_pool, metric)
            above = sketch.count_above(limit) if sketch is not None and not math.isnan(limit) else 0.0
            metrics.append(self._compare(f"{metric}_p{round(q * 100)}", observed, base, limit,
                                         [w.share_above(metric, limit) for w in cw],
                                         [w.share_above(metric, limit) for w in bw], above))
        metrics.append(self._error_rate(canary_pool, baseline_pool, len(cw), len(bw)))
        canary_kv = [w.kv_peak for w in cw if not math.isnan(w.kv_peak)]
        baseline_kv = [w.kv_peak for w in bw if not math.isnan(w.kv_peak)]
        base_kv = _median(baseline_kv)
        metrics.append(self._compare("kv_peak", _median(canary_kv), base_kv, base_kv + self.policy.kv_tolerance,
                                     canary_kv, baseline_kv))
        return tuple(metrics)

    def _enough(self, n: int) -> bool:
        return n >= self.policy.min_windows

    @property
    def look(self) -> int:
        """Which look at the evidence the tests are on: 0 before either side has ``min_windows``,
        then one more each time the side with fewer windows doubles its count."""
        fewer = min(len(self.canary.windows), len(self.baseline.windows))
        if fewer < self.policy.min_windows:
            return 0
        return int(math.log2(fewer / self.policy.min_windows)) + 1

    def _alpha(self, marginal: bool = False) -> float:
        """Significance per comparison at this look: Bonferroni over the comparisons, and look k
        spends ``6 / (pi**2 k**2)`` of the budget.

        >>> from specwatch.schemas.policy import AdmissionPolicy
        >>> judge = CanaryJudge(AdmissionPolicy(), [])
        >>> round(judge._alpha(), 6), round(judge._alpha(marginal=True), 6)
        (0.000868, 0.004342)
        """
        confidence = self.policy.marginal_confidence if marginal else self.policy.confidence
        k = max(1, self._tested_look + self._extra_looks)  # every look has an index of its own
        return (1.0 - confidence) / _COMPARISONS * 6.0 / (math.pi ** 2 * k ** 2)

    def _speedup(self, windows: list[WindowSample]) -> MetricVerdict:
        values = [w.speedup for w in windows if not math.isnan(w.speedup)]
        floor, median = self.policy.min_speedup, _median(values)
        p, outcome = math.nan, "pass"
        al = _median([w.acceptance_length for w in windows if not math.isnan(w.acceptance_length)])
        note = f"acceptance length {al:.3g}" if not math.isnan(al) else ""
        if not self._enough(len(values)):
            outcome, note = "marginal", "; ".join(filter(None, ("insufficient windows", note)))
        elif median < floor:
            p = _binomial_sf(sum(v < floor for v in values) - 1, len(values), 0.5)
            outcome = "fail" if p < self._alpha() else "marginal"
        return MetricVerdict("estimated_speedup", outcome, median, math.nan, floor, p,
                             (len(values), 0), note)

    def _compare(self, name: str, observed: float, base: float, limit: float, canary: list[float],
                 baseline: list[float], tail: float | None = None) -> MetricVerdict:
        """``observed`` against ``limit``, tested on the windows; ``tail`` (canary requests past a
        latency limit) under ``min_tail_requests`` is a few slow requests, not a tail."""
        canary = [v for v in canary if not math.isnan(v)]
        baseline = [v for v in baseline if not math.isnan(v)]
        windows = (len(canary), len(baseline))
        if not (self._enough(len(canary)) and self._enough(len(baseline))):
            return MetricVerdict(name, "marginal", observed, base, limit, math.nan, windows, "insufficient windows")
        p = mann_whitney_greater(canary, baseline)
        return self._verdict(name, observed, base, limit, p, windows, tail)

    def _verdict(self, name: str, observed: float, base: float, limit: float, p: float,
                 windows: tuple[int, int], tail: float | None = None) -> MetricVerdict:
        """Past ``limit`` and significant: fail at ``confidence``, marginal at the marginal one."""
        if not observed > limit or not p < self._alpha(marginal=True):
            return MetricVerdict(name, "pass", observed, base, limit, p, windows)
        if tail is not None and tail < self.policy.min_tail_requests:
            return MetricVerdict(name, "pass", observed, base, limit, p, windows,
                                 f"{tail:.0f} requests past the limit, fewer than {self.policy.min_tail_requests}")
        outcome = "fail" if p < self._alpha() else "marginal"
        return MetricVerdict(name, outcome, observed, base, limit, p, windows,
                             "" if outcome == "fail" else "past the limit, not yet significant")

    def _error_rate(self, canary: SliceStats, baseline: SliceStats, canary_windows: int,
                    baseline_windows: int) -> MetricVerdict:
        """The canary's failures against the limit rate, by a one-sided binomial test on counts
        (most windows hold no failure, so a rank test on window rates would mislead)."""
        windows = (canary_windows, baseline_windows)
        base = baseline.error_rate
        limit = base + self.policy.error_tolerance
        observed = canary.error_rate
        if not (self._enough(canary_windows) and self._enough(baseline_windows)) or math.isnan(limit):
            return MetricVerdict("error_rate", "marginal", observed, base, limit, math.nan, windows,
                                 "insufficient windows")
        failures = canary.errors + canary.timeouts
        p = _binomial_sf(failures - 1, canary.requests, min(1.0, limit)) if failures else 1.0
        return self._verdict("error_rate", observed, base, limit, p, windows)

    def _quality(self) -> MetricVerdict:
        checks, outcome, note = self.shadow_checks, "pass", ""
        if self.mismatches:
            ts, request_id, check = self.mismatches[0]
            outcome, note = "fail", f"strict mismatch {request_id} ({check}) at {ts}"
        elif self.require_shadow_checks and checks < self.policy.min_shadow_checks:
            outcome, note = "marginal", f"{checks} of {self.policy.min_shadow_checks} shadow checks"
        return MetricVerdict("shadow_mismatches", outcome, float(len(self.mismatches)), 0.0, 0.0,
                             math.nan, (checks, 0), note)


def _median(values: list[float]) -> float:
    return float(np.median(values)) if values else math.nan
