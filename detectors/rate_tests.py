"""The key monitor's sequential rate tests: a pair of Bernoulli CUSUMs per rate (a rise and a
burst), sized for the key's traffic, and the rates of errors and latency tails they judge against."""

from __future__ import annotations

import math

from .gates import BernoulliCusum, cusum_threshold

__all__ = ["error_rate_limit", "first_to_fire", "rate_tests", "retune", "tail_rates"]

# Sequential tests size their threshold for traffic up to this multiple of what a key learned at.
_TRAFFIC_HEADROOM = 4.0
# The tail test's rise over the baseline share, and the burst test's over that (docs/EVALUATION.md).
_TAIL_RISE = 4.0
_UNKNOWN_TRAFFIC_PER_SECOND = 1.0
_BURST_RISE = 4.0


def error_rate_limit(cfg, base: float) -> float:
    """The error rate that matters: what the error test is tuned to, and what a restore must stay under.

    >>> from specwatch.schemas.policy import ErrorPolicy
    >>> error_rate_limit(ErrorPolicy(), 0.004), error_rate_limit(ErrorPolicy(), math.nan)
    (0.02, 0.01)
    """
    return max(cfg.floor_rate, base * cfg.factor) if not math.isnan(base) else cfg.floor_rate


def _alternatives(p0: float, p1: float) -> tuple[float, list[float]]:
    """The baseline rate and the two alternatives of a pair of rate tests (the rise, the burst)."""
    p0 = min(max(p0, 1e-6), 0.5)
    return p0, [min(max(alternative, p0 * 1.01), 0.99) for alternative in (p1, p1 * _BURST_RISE)]


def retune(tests: list[BernoulliCusum], p0: float, p1: float) -> None:
    """Judge a pair of rate tests' next trials against ``p0`` and ``p1`` (see `_alternatives`)."""
    p0, alternatives = _alternatives(p0, p1)
    for test, alternative in zip(tests, alternatives):
        test.retune(p0, alternative)


def tail_rates(cfg, share: float) -> tuple[float, float]:
    """Baseline and alternative of the tail test for a baseline ``share`` past the limit.

    >>> from specwatch.schemas.policy import LatencyPolicy
    >>> tail_rates(LatencyPolicy(), 0.002), tail_rates(LatencyPolicy(), 0.02)
    ((0.0075, 0.03), (0.02, 0.08))
    """
    p1 = max(cfg.tail_share, share * _TAIL_RISE)
    return max(share, p1 / _TAIL_RISE), p1


def rate_tests(p0: float, p1: float, requests_per_second: float, false_alarms_per_hour: float,
                min_hits: int) -> list[BernoulliCusum]:
    """Bernoulli CUSUMs for a rise from p0 to ``p1`` and to a burst ``_BURST_RISE`` times that,
    each with half the false-alarm budget; none if p0 is unknown.

    >>> [(round(t.p0, 4), round(t.p1, 4), round(t.threshold, 2)) for t in rate_tests(0.002, 0.01, 10.0, 1e-2, 5)]
    [(0.002, 0.01, 17.18), (0.002, 0.04, 17.18)]
    >>> rate_tests(math.nan, 0.01, 10.0, 1e-2, 5)
    []
    """
    if math.isnan(p0):
        return []
    p0, alternatives = _alternatives(p0, p1)
    rate = requests_per_second if requests_per_second > 0 else _UNKNOWN_TRAFFIC_PER_SECOND
    threshold = cusum_threshold(rate * 3600.0 * _TRAFFIC_HEADROOM, false_alarms_per_hour / 2)
    return [BernoulliCusum(p0, alternative, threshold, min_hits) for alternative in alternatives]


def first_to_fire(tests: list[BernoulliCusum], trials: int, hits: float, at: float) -> BernoulliCusum | None:
    """Feed one slice's trials to every test; the first (in order) that fired, if any."""
    for test in tests:
        test.update(trials, hits, at)
    return next((test for test in tests if test.drift_detected), None)
